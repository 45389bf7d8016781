from pathlib import Path

# The tiny trained DeepSeek-V4 (``scripts/make_tiny_model.py --arch deepseek_v4``), the
# embedded default before the tiny DeepSeek-V4.1: for tests of V4 specifics (HF
# transformers' deepseek_v4 as the reference, hash-routed layers, CSA/HCA cache groups,
# decode CUDA graphs).
TINY_V4_MODEL = str(Path(__file__).resolve().parent / "data" / "tiny-v4-model")
