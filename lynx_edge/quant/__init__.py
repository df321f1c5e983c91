"""INT4 experts: int4.py (the format: quantise/pack/unpack/dequant reference, Int4Experts),
gptq.py (RTN and GPTQ quantizers, GPTQ checkpoint writer), formats.py (GPTQ checkpoint reader)."""
