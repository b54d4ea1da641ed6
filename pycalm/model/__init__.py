"""The model as data: its config (config.py), the number formats bit by bit (formats.py), the
pycalm file that holds weights, tokenizer and chat template (loader.py), and the tokenizer."""
