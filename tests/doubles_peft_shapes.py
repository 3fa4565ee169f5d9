"""Fault-injecting doubles of the hf_peft backend for peft-adapter-io's shape variants
(tests/test_peft_adapter_shapes.py): a PEFT that no longer says what is wrong with an adapter whose
tensors are not the model's shape, or loads it wrongly. Named by import path (`doubles_peft_shapes:Class`)."""

from __future__ import annotations

import warnings
from unittest import mock

import torch

from harness.backends.hf_peft import HfPeft


class SavesWithoutShapeCheck(HfPeft):
    """save_pretrained with peft's invalid-shape validator gone: an ungathered adapter saved without a word."""

    def save(self, ctx, model, directory):
        with mock.patch("peft.utils.save_and_load._validate_lora_adapter_state_dict", lambda *a, **k: None):
            super().save(ctx, model, directory)


class LoadsBadShapesQuietly(HfPeft):
    """A load that leaves out every file tensor of the wrong shape and says nothing (ignore_mismatched_sizes
    with the warnings silenced): an ungathered adapter loads as if it were whole."""

    def load(self, ctx, model, directory, adapter="default"):
        from peft import PeftModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return PeftModel.from_pretrained(model, str(directory), adapter_name=adapter, ignore_mismatched_sizes=True)


class LoadsMismatchedCorner(HfPeft):
    """A load that, instead of leaving a mismatched tensor at its fresh values, copies the file's leading
    block into it (what a loader that slices to fit would do)."""

    def load(self, ctx, model, directory, adapter="default"):
        loaded = super().load(ctx, model, directory, adapter)
        file = self.read_full(ctx, directory)
        with torch.no_grad():
            for n, t in loaded.named_parameters():
                v = file.get(".".join(s for s in n.split(".") if s != adapter))
                if v is not None and v.shape != t.shape and v.dim() == t.dim():
                    block = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, v.shape))
                    t[block] = v[block]
        return loaded
