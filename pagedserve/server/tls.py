"""HTTPS for ``pagedserve serve`` (vLLM's ``--ssl-keyfile``, ``--ssl-certfile``,
``--ssl-ca-certs``, ``--ssl-cert-reqs``): the files are checked by building the TLS context
uvicorn will build, before any model loads, so that a missing file, a key that is not the
certificate's or a passphrase-protected key (uvicorn would prompt for its passphrase on the
terminal) is a one-line error, not a traceback once the engines are up.
"""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import Any

from pagedserve.errors import ConfigError

# --ssl-cert-reqs: Python's ssl.CERT_NONE, CERT_OPTIONAL and CERT_REQUIRED, as vLLM takes them.
CERT_REQS = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)


def tls_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.run's TLS keywords for the flags, {} for plain HTTP; ``ConfigError`` if the
    files cannot make a server's TLS context."""
    if args.ssl_certfile is None:
        given = [flag for flag, value in (("--ssl-keyfile", args.ssl_keyfile),
                                          ("--ssl-ca-certs", args.ssl_ca_certs)) if value]
        if given or args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ConfigError(f"{given[0] if given else '--ssl-cert-reqs'} needs "
                              "--ssl-certfile, the server's certificate (PEM)")
        return {}
    if args.ssl_cert_reqs != ssl.CERT_NONE and args.ssl_ca_certs is None:
        raise ConfigError("--ssl-cert-reqs 1 or 2 checks client certificates against "
                          "--ssl-ca-certs: give the CA certificates (PEM)")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An empty passphrase: an encrypted key fails here rather than prompting.
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=b"")
    except OSError as exc:  # ssl.SSLError is one
        keyfile = f" with --ssl-keyfile {args.ssl_keyfile}" if args.ssl_keyfile else ""
        raise ConfigError(f"--ssl-certfile {args.ssl_certfile}{keyfile}: not a certificate "
                          f"and its unencrypted private key in PEM ({_why(exc)})") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except OSError as exc:
            raise ConfigError(f"--ssl-ca-certs {args.ssl_ca_certs}: no CA certificates in PEM "
                              f"({_why(exc)})") from None
    return {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile,
            "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs}


def _why(exc: OSError) -> str:
    return getattr(exc, "reason", None) or exc.strerror or str(exc)
