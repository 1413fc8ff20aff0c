"""Developer tools: Triton kernel launch capture, and their compile checks and resource reports for sm_80/sm_90."""
