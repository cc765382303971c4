"""What runs on each tensor-parallel rank: the rank's setup (``worker``), its model runner, the
packing of a step's inputs, the KV pool's size. The engine reaches it only through the executor
and the step's types (``step``)."""
