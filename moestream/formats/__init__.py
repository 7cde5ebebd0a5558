"""File formats: GGUF reading and writing, quant block codecs, the tokenizer and chat templates."""
