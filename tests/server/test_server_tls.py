"""HTTPS (``--ssl-certfile``, ``--ssl-keyfile``, ``--ssl-ca-certs``, ``--ssl-cert-reqs``) and
``--root-path``: the certificate files are refused in one line before any model loads, and a
server behind both answers the OpenAI SDK over TLS, checked against its own certificate."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the certificates are made with the openssl command")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1 and its key, EC P-256 (fast to make)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2",
             "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1")
    return cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder, "server")
    other_cert, other_key = _self_signed(folder, "other")
    encrypted = folder / "encrypted.key"
    _openssl("pkey", "-in", str(key), "-aes256", "-passout", "pass:secret", "-out", str(encrypted))
    not_pem = folder / "not.pem"
    not_pem.write_text("hello\n")
    return {"cert": cert, "key": key, "other_key": other_key, "encrypted": encrypted,
            "not_pem": not_pem, "both": _joined(folder, cert, key)}


def _joined(folder: Path, *parts: Path) -> Path:
    path = folder / "cert_and_key.pem"
    path.write_text("".join(p.read_text() for p in parts))
    return path


def _args(**flags) -> argparse.Namespace:
    return argparse.Namespace(**{"ssl_certfile": None, "ssl_keyfile": None, "ssl_ca_certs": None,
                                 "ssl_cert_reqs": ssl.CERT_NONE, **flags})


@pytest.mark.parametrize(("flags", "says"), [
    ({"ssl_keyfile": "key"}, "--ssl-keyfile needs --ssl-certfile"),
    ({"ssl_ca_certs": "cert"}, "--ssl-ca-certs needs --ssl-certfile"),
    ({"ssl_cert_reqs": ssl.CERT_REQUIRED}, "--ssl-cert-reqs needs --ssl-certfile"),
    ({"ssl_certfile": "cert", "ssl_keyfile": "key", "ssl_cert_reqs": ssl.CERT_REQUIRED},
     "checks client certificates against --ssl-ca-certs"),
    ({"ssl_certfile": "missing", "ssl_keyfile": "key"}, "no such file"),
    # A key of another certificate, and one uvicorn would ask the terminal's passphrase for.
    ({"ssl_certfile": "cert", "ssl_keyfile": "other_key"},
     "not a certificate and its unencrypted private key"),
    ({"ssl_certfile": "cert", "ssl_keyfile": "encrypted"},
     "not a certificate and its unencrypted private key"),
    ({"ssl_certfile": "not_pem", "ssl_keyfile": "key"},
     "not a certificate and its unencrypted private key"),
    ({"ssl_certfile": "cert", "ssl_keyfile": "key", "ssl_ca_certs": "not_pem"},
     "no CA certificates in PEM"),
])
def test_tls_files_that_cannot_serve_are_refused(certs, tmp_path, flags, says):
    from pagedserve.errors import ConfigError
    from pagedserve.server.tls import tls_options

    paths = {name: str(certs.get(value, tmp_path / value)) if isinstance(value, str) else value
             for name, value in flags.items()}
    with pytest.raises(ConfigError, match=says):
        tls_options(_args(**paths))


def test_tls_files_that_serve_become_uvicorns_keywords(certs):
    from pagedserve.server.tls import tls_options

    assert tls_options(_args()) == {}
    options = tls_options(_args(ssl_certfile=str(certs["cert"]), ssl_keyfile=str(certs["key"]),
                                ssl_ca_certs=str(certs["cert"]), ssl_cert_reqs=ssl.CERT_OPTIONAL))
    assert options == {"ssl_certfile": str(certs["cert"]), "ssl_keyfile": str(certs["key"]),
                       "ssl_ca_certs": str(certs["cert"]), "ssl_cert_reqs": ssl.CERT_OPTIONAL}
    both = tls_options(_args(ssl_certfile=str(certs["both"])))  # the key after the certificate
    assert both["ssl_certfile"] == str(certs["both"]) and both["ssl_keyfile"] is None


def test_a_bad_certificate_fails_before_any_model_loads(certs, tmp_path, capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "no-model-here"), "--port", "0",
              "--ssl-certfile", str(certs["cert"]), "--ssl-keyfile", str(certs["other_key"])])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve: error: --ssl-certfile ") and err.count("\n") == 1


@pytest.mark.parametrize("value", ["llm", "v1/x"])
def test_a_root_path_must_be_a_path(value, capsys):
    from pagedserve.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["serve", "--root-path", value])
    assert "argument --root-path: must be a URL path starting with /" in capsys.readouterr().err


def test_the_api_over_https_behind_a_root_path(chat_model, certs, tmp_path):
    with launch_server(chat_model, tmp_path, "--ssl-certfile", str(certs["cert"]),
                       "--ssl-keyfile", str(certs["key"]), "--root-path", "/llm/",
                       "--enable-docs", api_key="k3y", tls_ca=certs["cert"]) as server:
        assert server.url.startswith("https://")
        checked = ssl.create_default_context(cafile=certs["cert"])
        from openai import OpenAI

        # The SDK over TLS, the server's certificate checked.
        client = OpenAI(base_url=f"{server.url}/v1", api_key="k3y", max_retries=0,
                        http_client=httpx.Client(verify=checked, timeout=60))
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content
        # A client that checks against the system's CAs does not trust this certificate.
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{server.url}/health", timeout=10)
        # Plain HTTP to the TLS port gets no answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
        # The proxy strips the prefix: the routes, /health's exemption from the key included,
        # are where they were, and the generated docs name the prefix.
        health = httpx.get(f"{server.url}/health", verify=checked, timeout=10)
        assert health.status_code == 200
        refused = httpx.get(f"{server.url}/v1/models", verify=checked, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers, verify=checked,
                           timeout=10).json()
        assert schema["servers"] == [{"url": "/llm"}]
        assert "/v1/chat/completions" in schema["paths"]
