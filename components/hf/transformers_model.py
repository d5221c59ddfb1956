"""The project's decoder as a Hugging Face transformers model, registered on import of this module.

    import components.hf.transformers_model  # registers k3_sandbox (and kimi_k3, while transformers has none)
    model = AutoModelForCausalLM.from_pretrained(OUT)   # any folder analysis.export wrote
    tokenizer = AutoTokenizer.from_pretrained(OUT)

Without importing the project first, ``trust_remote_code=True`` reaches the same classes through the
``auto_map`` of the folder's config.json, whose ``modeling_k3_sandbox.py`` imports this module from the
installed project (``pip install 'k3-sandbox[hf]'``). There is no second implementation: the model is
``components.model.Decoder``, built from the run config the folder carries (its ``k3_sandbox``
section) and loaded by ``components.hf.weights_folder.import_weights`` (either key prefix, MXFP4 experts
dequantised). ``generate()`` decodes incrementally through ``SandboxCache``, a transformers ``Cache``
holding the decoder's own per-layer states (K/V, MLA latents, KDA recurrent and convolution states).

* ``K3SandboxConfig`` / ``K3SandboxForCausalLM`` (``model_type: k3_sandbox``): every export that no
  transformers class computes exactly (``components/hf/native.py``).
* ``KimiK3SandboxConfig`` / ``KimiK3SandboxForConditionalGeneration`` (``model_type: kimi_k3``): K3
  exports with the release's multimodal prefix, in the release's top-level schema (the text backbone
  under ``text_config``). Registered only while transformers itself has no ``kimi_k3``.

Padded batches are refused (``attention_mask`` with zeros): the decoder has no padding mask.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from huggingface_hub import snapshot_download
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from components.config_from_dict import decoder_config_from_container
from components.decode_cache import DecoderCache
from components.hf.config_json import SANDBOX_KEY
from components.hf.modeling_file import KIMI_K3_MODEL_TYPE, SANDBOX_MODEL_TYPE, write_modeling_file
from components.hf.weights_folder import export_weights, import_weights
from components.model import Decoder
from components.objective import cross_entropy


class K3SandboxConfig(PreTrainedConfig):
    """config.json of an export: the run's composed config (``k3_sandbox``) decides the model; the
    flat fields (hidden size, vocabulary, the release's K3 fields) describe it to other tools."""

    model_type = SANDBOX_MODEL_TYPE
    k3_sandbox: Optional[dict] = None
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    tie_word_embeddings: bool = False
    use_cache: bool = True


class KimiK3TextConfig(PreTrainedConfig):
    """The release's ``text_config`` (the Kimi Linear schema of K3's text backbone), kept as read."""

    model_type = "kimi_linear"
    vocab_size: Optional[int] = None
    hidden_size: Optional[int] = None
    num_hidden_layers: Optional[int] = None
    tie_word_embeddings: bool = False


class KimiK3SandboxConfig(PreTrainedConfig):
    """The release's top-level ``kimi_k3`` schema (text backbone under ``text_config``), with the run's
    composed config beside it."""

    model_type = KIMI_K3_MODEL_TYPE
    sub_configs_defaults = {"text_config": KimiK3TextConfig}
    text_config: Optional[Any] = None
    k3_sandbox: Optional[dict] = None
    tie_word_embeddings: bool = False
    use_cache: bool = True


class SandboxCache(Cache):
    """The decoder's own cache (``components.decode_cache.DecoderCache``) as a transformers ``Cache``: the
    number of tokens seen, per-layer states created by each mixer on first use."""

    def __init__(self, decoder: Decoder):
        super().__init__(layers=[])
        self.decoder_cache: DecoderCache = decoder.new_cache()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.decoder_cache.seq_len

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1  # grows without bound

    @property
    def is_compileable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows of every per-layer state reordered (beam search)."""
        for state in self.decoder_cache.layers:
            if state is None:
                continue
            for name, value in vars(state).items():
                if isinstance(value, torch.Tensor):
                    setattr(state, name, value.index_select(0, beam_idx.to(value.device)))

    def __len__(self) -> int:
        return len(self.decoder_cache.layers)

    def __repr__(self) -> str:
        return f"SandboxCache(seq_len={self.decoder_cache.seq_len}, layers={len(self.decoder_cache.layers)})"


class K3SandboxForCausalLM(PreTrainedModel, GenerationMixin):
    """``components.model.Decoder`` behind transformers' causal-LM interface."""

    config_class = K3SandboxConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: PreTrainedConfig):
        super().__init__(config)
        run_config = getattr(config, SANDBOX_KEY, None)
        if not run_config:
            raise ValueError(
                f"{type(config).__name__} has no '{SANDBOX_KEY}' section: not a folder this project exported"
            )
        self.model = Decoder(decoder_config_from_container(run_config))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the decoder's own (forward creates a SandboxCache)

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # the decoder initialises itself; weights come from the folder

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        past_key_values: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int = 0,
        return_dict: Optional[bool] = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("K3SandboxForCausalLM takes input_ids (inputs_embeds are not supported)")
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.bool().all()):
            raise ValueError(
                "K3SandboxForCausalLM: padded batches are not supported (attention_mask has zeros); "
                "run sequences one at a time or of equal length"
            )
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = SandboxCache(self.model)
        if cache is not None and not isinstance(cache, SandboxCache):
            raise TypeError(f"K3SandboxForCausalLM keeps its own cache (SandboxCache), got {type(cache).__name__}")
        hidden = self.model.hidden_states(input_ids, cache.decoder_cache if cache is not None else None)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.model.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = cross_entropy(logits[:, :-1], labels[:, 1:].to(logits.device), reduction="mean")
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args: Any,
        config: Optional[PreTrainedConfig] = None,
        dtype: Any = None,
        torch_dtype: Any = None,
        device_map: Any = None,
        revision: Optional[str] = None,
        **kwargs: Any,
    ) -> "K3SandboxForCausalLM":
        """The folder's model: its composed config, its weights through the project's own importer
        (``dtype``: "auto" keeps the checkpoint's, a torch dtype casts; ``device_map``: one device)."""
        folder = _local_folder(str(pretrained_model_name_or_path), revision)
        if config is None or not isinstance(config, cls.config_class):
            config = cls.config_class.from_pretrained(folder)
        model = cls(config)
        import_weights(folder, model.model)
        dtype = dtype if dtype is not None else torch_dtype
        if dtype == "auto":
            dtype = getattr(config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        device = _one_device(device_map)
        if device is not None:
            model = model.to(device)
        if os.path.isfile(os.path.join(folder, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(folder)
        model.name_or_path = str(pretrained_model_name_or_path)
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """The folder ``analysis.export`` would write for this model's weights (text-only prefix)."""
        os.makedirs(save_directory, exist_ok=True)
        export_weights(self.model, str(save_directory))
        self.config.save_pretrained(save_directory)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(save_directory)
        write_modeling_file(str(save_directory))


class KimiK3SandboxForConditionalGeneration(K3SandboxForCausalLM):
    """A K3 export in the release's ``kimi_k3`` schema (text only: the folder holds no vision tower)."""

    config_class = KimiK3SandboxConfig


def _local_folder(name: str, revision: Optional[str]) -> str:
    if os.path.isdir(name):
        return name
    return snapshot_download(name, revision=revision)


def _one_device(device_map: Any) -> Optional[torch.device]:
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        devices = set(device_map.values())
        if len(devices) != 1:
            raise ValueError(f"K3SandboxForCausalLM loads onto one device, got device_map {device_map}")
        device_map = devices.pop()
    if device_map == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device_map if not isinstance(device_map, int) else f"cuda:{device_map}")


def transformers_has_kimi_k3() -> bool:
    """Whether the installed transformers has its own ``kimi_k3`` model type."""
    return KIMI_K3_MODEL_TYPE in CONFIG_MAPPING_NAMES


def register() -> None:
    AutoConfig.register(SANDBOX_MODEL_TYPE, K3SandboxConfig, exist_ok=True)
    AutoModelForCausalLM.register(K3SandboxConfig, K3SandboxForCausalLM, exist_ok=True)
    if not transformers_has_kimi_k3():
        AutoConfig.register(KIMI_K3_MODEL_TYPE, KimiK3SandboxConfig, exist_ok=True)
        AutoModelForCausalLM.register(KimiK3SandboxConfig, KimiK3SandboxForConditionalGeneration, exist_ok=True)


register()
