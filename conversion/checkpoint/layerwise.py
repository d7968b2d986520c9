"""Layer-by-layer calibration: every decoder layer's attention input with one layer's weights in memory.

Shape notation used throughout this module:
    N    calibration tokens, split into W windows of at most T tokens (the last one may be shorter)
    C    hidden size, D the RoPE width (head_dim)

The calibrated converters need, for every layer, the input of its `self_attn` on the calibration windows
(`LayerwiseModel.for_each_attention_input`'s callback contract: `fn(layer, x, (cos, sin))`). Loading the whole
source in float32 costs 4 bytes per parameter (about 28 GB for a 7B model). `LayerwiseModel` instead builds
the model skeleton on the `meta` device from config.json and runs the calibration layer after layer, the way
GPTQ/AWQ-style tools calibrate large models on small devices:

    h = embed(ids)                                       W windows, each (1, T, C), in the forward dtype
    for i in 0 .. last wanted layer:
        load layer i from the safetensors shards         one layer on --device, in the forward dtype
        for every window: fn(i, x, (cos, sin)) with x = input_layernorm(h), the input of self_attn, then
                          h <- layer_i(h) (RoPE from the config's rotary embedding, the model's causal or
                          sliding-window mask), except in the last wanted layer
        free layer i

Peak memory: one decoder layer + the carried hidden states (N * C numbers in the forward dtype) + one window's
activations, whatever the depth (the embedding matrix is read in blocks of rows, never whole).

The callback always runs on the CPU with float32 tensors and a float32 `self_attn`, as it did on the
float32 model: the statistics code is CPU code and accumulates in float64. With `--forward-dtype bfloat16`
x and (cos, sin) are exact upcasts of the bfloat16 activations and the `self_attn` seen by the callback
holds the checkpoint's weights cast to float32 (a second read of the layer's attention tensors); with
`--device cuda` only the layers' forward runs on the GPU and each window's x is copied to the CPU.
"""

from __future__ import annotations

import copy
import itertools
import os
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import init_empty_weights
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from hf_attn.conversion import stages
from hf_attn.conversion.checkpoint.io import TensorInfo, layer_attn_keys, read_tensor, tensor_index
from hf_attn.conversion.checkpoint.threads import CoreShare
from hf_attn.conversion.specs import DEFAULT_WINDOW, resolve_forward
from hf_attn.models.llama_mla.modeling_llama_mla import CACHE_ARG  # the transformers version's name
from hf_attn.tooling.devices import DEFAULT_DEVICE, announce_device, resolve_device, warn_emulated_bfloat16
from hf_attn.tooling.loading import check_token_ids

EMBEDDING_KEY = "model.embed_tokens.weight"
EMBEDDING_BLOCK_BYTES = 64 * 1024**2  # the embedding matrix is read in blocks of rows of at most this size

# fn(layer, x, position_embeddings): what a calibration pass calls with every wanted layer's attention input
AttentionInputFn = Callable[[int, torch.Tensor, "tuple[torch.Tensor, torch.Tensor] | None"], None]


def forward_record(device: str, forward_dtype: str) -> dict:
    """What a conversion record says about the calibration forward: the device it ran on ("cpu" or
    "cuda", `--device auto` resolved) and its dtype."""
    return {"device": resolve_device(device).type, "forward_dtype": forward_dtype}


def is_sliding_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` attends within `config.sliding_window`, as the model classes decide:
    `layer_types` when the config has them (Qwen2), else any `sliding_window` (Mistral; Llama has none)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


class LayerwiseModel:
    """A Llama-family causal LM whose decoder layers are read from the safetensors shards one at a time.

    Quacks like the loaded model where the calibration code looks: `model.layers[i].self_attn` (materialised
    while layer i's callbacks run, on the `meta` device otherwise) and `config`.
    `max_layers_loaded` counts the most decoder layers ever materialised at once (1, whatever the depth).
    """

    def __init__(
        self, src_dir: str | os.PathLike, *, device: str = DEFAULT_DEVICE, forward_dtype: str = "float32"
    ) -> None:
        self.device, self.dtype = resolve_forward(device, forward_dtype)
        if self.dtype == torch.bfloat16:
            warn_emulated_bfloat16(self.device, "--forward-dtype")
        self.src_dir = Path(src_dir)
        self.index = tensor_index(self.src_dir)
        config = AutoConfig.from_pretrained(self.src_dir)
        with init_empty_weights(include_buffers=False):  # parameters on `meta`, buffers computed
            causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model = causal_lm.model.eval()  # the decoder stack, every weight on `meta`
        self.config = causal_lm.config
        # buffers the checkpoint does not hold but the config defines (llama_mla's `rope_dims`): kept here
        # and put back whenever their module is materialised (freeing a layer moves them to `meta` too)
        self._computed = {
            name: buffer.clone()
            for name, buffer in self.model.named_buffers()
            if name.startswith("layers.") and f"model.{name}" not in self.index
        }
        # inv_freq is computed from the config (rope scaling included), so build it off `meta`
        self.rotary = type(self.model.rotary_emb)(config=self.config).to(self.device)
        self.num_layers = len(self.model.layers)
        self.max_layers_loaded = 0
        self._loaded: set[int] = set()

    def _info(self, name: str) -> TensorInfo:
        if name not in self.index:
            raise KeyError(f"Tensor {name!r} is missing from the checkpoint {self.src_dir}.")
        return self.index[name]

    def _materialise(self, module: torch.nn.Module, prefix: str, *, device, dtype) -> None:
        """Load `module`'s weights `prefix + name` from the shards (floating ones cast to `dtype`)."""
        state = {}
        with stages.stage("read"):
            for name in module.state_dict():
                tensor = read_tensor(self._info(prefix + name))
                state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
        module.load_state_dict(state, strict=True, assign=True)
        inside = prefix.removeprefix("model.")
        for name, buffer in self._computed.items():
            if name.startswith(inside):
                owner, _, attr = name[len(inside) :].rpartition(".")
                module.get_submodule(owner)._buffers[attr] = buffer.to(device)
        left = [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.is_meta]
        if left:
            raise ValueError(f"{prefix}: tensors not in the checkpoint and not computable: {left}")

    def load_layer(self, layer: int) -> torch.nn.Module:
        """Decoder layer `layer` with its weights, in the forward dtype on the forward device."""
        module = self.model.layers[layer]
        self._materialise(module, f"model.layers.{layer}.", device=self.device, dtype=self.dtype)
        self._loaded.add(layer)
        self.max_layers_loaded = max(self.max_layers_loaded, len(self._loaded))
        return module

    def free_layer(self, layer: int) -> None:
        self.model.layers[layer].to_empty(device="meta")
        self._loaded.discard(layer)

    def attention_weights(self, layer: int) -> dict[str, torch.Tensor | None]:
        """Layer's attention tensors in float32 (None: no bias)."""
        keys = layer_attn_keys(layer)
        return {k: read_tensor(self.index[n]).float() if n in self.index else None for k, n in keys.items()}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (N,) -> (N, C) in the forward dtype on the forward device. The embedding matrix is read
        in blocks of rows of at most EMBEDDING_BLOCK_BYTES, so it is never in memory whole."""
        info = self._info(EMBEDDING_KEY)
        vocab, hidden = info.shape
        check_token_ids(input_ids, vocab)  # a tokenizer larger than the embedding: one line
        if input_ids.numel() and int(input_ids.min()) < 0:
            raise ValueError(f"Negative token ids {int(input_ids.min())}")
        announce_device(self.device)  # every pass starts here: the running command says where it computes
        row_bytes = (info.end - info.begin) // vocab
        rows = max(1, EMBEDDING_BLOCK_BYTES // row_bytes)
        out = torch.empty(len(input_ids), hidden, dtype=self.dtype)  # (N, C)
        for start in range(0, vocab, rows):
            stop = min(vocab, start + rows)
            picked = ((input_ids >= start) & (input_ids < stop)).nonzero().squeeze(1)  # positions in ids
            if len(picked):  # rows start .. stop - 1, (stop - start, C)
                begin, end = info.begin + start * row_bytes, info.begin + stop * row_bytes
                block = read_tensor(replace(info, shape=(stop - start, hidden), begin=begin, end=end))
                out[picked] = block[input_ids[picked] - start].to(self.dtype)
        return out.to(self.device)

    def layer_kwargs(self, h: torch.Tensor, layer: int, cache: dict) -> dict:
        """The keyword arguments of decoder layer `layer` for a window h (1, T, C), as the model passes them:
        its causal or sliding-window mask, position_ids (1, T) and (cos, sin) each (1, T, D) (`cache`: a dict
        the caller keeps, one mask and RoPE table per window length and layer kind)."""
        t, sliding = h.shape[1], is_sliding_layer(self.config, layer)
        if (t, sliding) not in cache:
            position_ids = torch.arange(t, device=self.device).unsqueeze(0)  # (1, T)
            make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
            mask = make_mask(
                config=self.config,
                inputs_embeds=h,
                attention_mask=None,
                position_ids=position_ids,
                **{CACHE_ARG: None},
            )
            rope = self.rotary(h, position_ids)  # (cos, sin)
            cache[t, sliding] = dict(
                attention_mask=mask, position_ids=position_ids, position_embeddings=rope, use_cache=False
            )
        return dict(cache[t, sliding])

    def _statistics_attention(self, layer: int) -> torch.nn.Module | None:
        """A float32 CPU copy of layer's self_attn for the callback, or None when the forward one is that."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            return None
        attn = copy.deepcopy(self.model.layers[layer].self_attn)  # on meta: copies no weights
        self._materialise(attn, f"model.layers.{layer}.self_attn.", device="cpu", dtype=torch.float32)
        return attn

    def for_each_attention_input(
        self,
        input_ids: torch.Tensor,
        fn: AttentionInputFn,
        *,
        window: int = DEFAULT_WINDOW,
        layers: Iterable[int] | None = None,
        progress: bool = True,
    ) -> None:
        """Run the model over disjoint windows of `input_ids` (N,), one decoder layer at a time, and call
        fn(layer, x, (cos, sin)) for every wanted layer and window: x (1, T, C) the input of
        `model.layers[layer].self_attn` (after input_layernorm), cos and sin (1, T, D), in float32 on the CPU,
        T <= window. Nothing is kept: the caller accumulates what it needs. Windows are visited in order
        within a layer; layers after the last wanted one are never read."""
        wanted = sorted(set(range(self.num_layers) if layers is None else layers))
        if not wanted or wanted[0] < 0 or wanted[-1] >= self.num_layers:
            raise ValueError(f"layers must be in [0, {self.num_layers}), got {wanted}")
        last, wanted = wanted[-1], set(wanted)
        with torch.inference_mode():
            hidden = [w.unsqueeze(0) for w in self.embed(input_ids).split(window)]  # W x (1, T, C)
            cache: dict = {}
            bar = tqdm(
                total=(last + 1) * len(hidden), desc="calibration", unit="window", disable=not progress
            )
            with CoreShare() as share:  # CPU threads: the cores other processes leave free
                for i in range(last + 1):
                    share.update()
                    bar.set_postfix(layer=i)
                    use = fn if i in wanted else None
                    self._run_layer(i, hidden, use, stop=i == last, cache=cache, bar=bar)
            bar.close()

    def _run_layer(self, i: int, hidden: list, fn, *, stop: bool, cache: dict, bar) -> None:
        """Carry every window through layer i (in place in `hidden`; not when `stop`: the last wanted layer's
        output is never needed), calling fn on its attention inputs: input_layernorm(h), as the layer hands
        its self_attn (`refine_fit`'s reading of a decoder layer too), and the window's (cos, sin)."""
        stats_attn = self._statistics_attention(i) if fn is not None else None  # (copied while on meta)
        block = self.load_layer(i)
        forward_attn = block.self_attn
        try:
            for w, h in enumerate(hidden):
                kwargs = self.layer_kwargs(h, i, cache)
                if fn is not None:
                    with stages.stage("calibration forward"):
                        x = block.input_layernorm(h).to(device="cpu", dtype=torch.float32)  # (1, T, C)
                    pe = tuple(e.to(device="cpu", dtype=torch.float32) for e in kwargs["position_embeddings"])
                    if stats_attn is not None:
                        block.self_attn = stats_attn  # what `model.layers[i].self_attn` shows the callback
                    try:
                        with stages.stage("statistics"):
                            fn(i, x, pe)
                    finally:
                        block.self_attn = forward_attn
                if not stop:
                    with stages.stage("calibration forward"):
                        out = block(h, **kwargs)
                    hidden[w] = out[0] if isinstance(out, tuple) else out  # (1, T, C)
                bar.update(1)
        finally:
            self.free_layer(i)
            if stats_attn is not None:
                stats_attn.to_empty(device="meta")
