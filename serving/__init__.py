"""vLLM integration of the ZAYA1 MoE++ model (see serving/README.md). Importing this package imports nothing."""
