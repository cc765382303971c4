"""Executors: how the driver (scheduler, block manager, sampler) runs the model on every
tensor-parallel rank. One rank runs in the driver's process; the others in processes on this
host (``mp``) or in Ray actors (``ray``)."""
