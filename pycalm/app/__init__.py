"""What users run, on top of the engines: the CLI (cli.py, generate.py), the Python API (api.py),
the OpenAI-compatible server (serve.py), and the model downloads and cache (fetch.py, cache.py)."""
