"""Builders of what a backend saves: Megatron-Core GPT models (mcore), their parallel state
(parallel), training jobs (training: config, build, loop, state views), Megatron-Bridge models
(bridge), verl's vanilla mbridge (mbridge), HF fixtures and logits (hf) and the Megatron -> HF
PEFT name mapping (peft_mapping). Imports harness.core, harness.compat, harness.judge and each other."""
