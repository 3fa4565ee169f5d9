"""harness.compat.attention_env: megatron-core writes a model's attention backend into the process
environment and asserts on it, so two model families of different backends cannot be built in one
process; each harness build starts from the user's environment instead."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from harness.compat import attention_env as ae


@pytest.fixture
def clean_env(monkeypatch):
    for k in (*ae.VARIABLES, ae.USER_RECORD):  # set then delete: monkeypatch restores (removes) them afterwards
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    return monkeypatch


def _model(backend_name: str):
    from megatron.core.transformer.enums import AttnBackend

    return SimpleNamespace(config=SimpleNamespace(attention_backend=getattr(AttnBackend, backend_name), flash_attention_version=None))


def test_a_flash_model_after_an_auto_one_builds_once_the_env_is_fresh(clean_env):
    from megatron.core.models.common.language_module.language_module import LanguageModule

    ae.fresh_attention_env()  # records the user's values: none set
    LanguageModule._set_attention_backend(_model("auto"))  # a Llama: NVTE_FUSED_ATTN=1 in the process env
    assert ae.needed()
    with pytest.raises(AssertionError, match="NVTE_FUSED_ATTN set to 1, but expected 0"):
        LanguageModule._set_attention_backend(_model("flash"))  # a Gemma after it: the upstream behaviour adapted to
    ae.fresh_attention_env()
    assert not ae.needed() and all(k not in os.environ for k in ae.VARIABLES)
    LanguageModule._set_attention_backend(_model("flash"))
    assert os.environ["NVTE_FUSED_ATTN"] == "0" and os.environ["NVTE_FLASH_ATTN"] == "1"


def test_a_value_the_user_set_stays_and_upstream_judges_it(clean_env):
    from megatron.core.models.common.language_module.language_module import LanguageModule

    clean_env.setenv("NVTE_FUSED_ATTN", "1")  # the user's own choice
    ae.fresh_attention_env()
    LanguageModule._set_attention_backend(_model("auto"))  # agrees with it, and sets the other two
    ae.fresh_attention_env()
    assert os.environ["NVTE_FUSED_ATTN"] == "1" and "NVTE_FLASH_ATTN" not in os.environ and "NVTE_UNFUSED_ATTN" not in os.environ
    with pytest.raises(AssertionError, match="NVTE_FUSED_ATTN set to 1"):  # the user's value, judged by upstream
        LanguageModule._set_attention_backend(_model("flash"))
