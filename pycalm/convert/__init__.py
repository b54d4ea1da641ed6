"""Conversion of Hugging Face folders and GGUF files into pycalm files: the plan (common.py), its
two readers (hf.py, gguf.py), the q4 policy (quantize.py, calibrate.py) and the writer (main.py,
`python -m pycalm.convert`)."""
