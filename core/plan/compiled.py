"""What a ``torch.compile``'d decoder layer saves for backward, measured here, not guessed.

Under ``torch.compile`` (inductor), AOTAutograd's partitioner decides what a compiled region keeps for backward:
``min_cut_rematerialization_partition`` (torch/_functorch/partitioners.py) saves a minimum cut of the joint graph and
recomputes cheap pointwise ops in backward; matmuls and attention are never recomputed (``compute_intensive_ops``).
For a Llama layer it drops both RMSNorms' fp32 copies and the SiLU output and keeps the layer input and o_proj's
output to recompute them (docs/losses.md, "torch.compile").

:func:`compiled_layer_bytes` runs exactly that partition on this CPU: the model family's own decoder layer
(transformers' ``LlamaDecoderLayer`` ...) with the model's widths, its parameters allocated but never initialised, is
compiled with a backend made of inductor's decomposition table and inductor's own ``partition_fn`` (its joint-graph
passes, then the min-cut, ``compiler="inductor"``) and a forward "compiler" that only reads the forward graph: its
outputs after the real ones are the tensors saved for backward, whose shapes and dtypes the graph's nodes carry. No
kernel of the layer runs. The partition does not depend on the tokens (the same cut at every size, checked), so one
small micro-batch of :data:`PROBE_TOKENS` tokens (a prime no model width is a multiple of) is measured, and each saved
tensor is scaled by how its shape holds the sequence: not at all (autocast's 16-bit weight copies: per layer), once
(per token) or twice (a padding mask, b·s·s).

torchtune compiles each decoder layer as its own region (``training.compile_model``), as measured here; a whole-model
compile (Trainer's ``torch_compile``) may cut across layers (not measured). At ``activation_memory_budget`` 1.0 (the
default) the cut does not depend on the device; inductor's own buffers inside a kernel are not saved tensors and are
not counted. Imports torch and transformers (seconds, once per layer shape in a process).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

#: tokens of the micro-batch measured (a prime: a dimension of this size is the sequence's; the saved bytes are scaled to
#: the plan's batch and sequence)
PROBE_TOKENS = 37
_MEASURED: dict[tuple[Any, ...], CompiledLayer] = {}


@dataclass(frozen=True)
class CompiledLayer:
    """A compiled decoder layer's saved tensors for backward, per token (bytes), and what they are.

    Attributes:
        per_token: bytes saved per token of the micro-batch (parameters, and cos/sin shared by every layer, left
            out).
        tensors: ``(what, bytes at PROBE_TOKENS tokens)`` for each saved tensor, largest first.
        constant: bytes saved whatever the micro-batch (autocast's 16-bit copies of the layer's weights).
        per_token_squared: bytes saved per row per token squared (a padding mask reaching attention, b·s·s).
    """

    per_token: float
    tensors: tuple[tuple[str, int], ...]
    constant: int = 0
    per_token_squared: float = 0.0

    def saved_bytes(self, batch: int, seq_len: int) -> int:
        """Bytes one layer saves for backward at micro-batch ``batch`` x ``seq_len`` tokens."""
        return int(round(self.constant + self.per_token * batch * seq_len
                         + self.per_token_squared * batch * seq_len * seq_len))


def compiled_layer_bytes(config: Any, dtype: str, autocast: str | None, lora: Any = None, masked: bool = False
                         ) -> CompiledLayer:
    """What one compiled decoder layer of ``config``'s model saves for backward, per token.

    Args:
        config: the model's ``transformers.PretrainedConfig``.
        dtype: the parameters' dtype name (``bf16``; under amp ``fp32``).
        autocast: the autocast dtype name (amp), or None.
        lora: LoRA settings (``core.spec.LoraSettings``) for an adapted layer (the base frozen, adapters fp32), or
            None for a layer whose weights are all trained (full fine-tuning).
        masked: an attention mask (padding) reaches SDPA.

    Raises:
        ValueError: the model's decoder layer cannot be found or compiled here.
    """
    if hasattr(config, "to_transformers"):  # a Llama-family config.json read without transformers (core/plan/shapes.py)
        config = config.to_transformers()
    key = (config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config), dtype,
           autocast, None if lora is None else (lora.r, tuple(lora.targets)), masked)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(config, dtype, autocast, lora, masked)
    return _MEASURED[key]


def _layer(config: Any, dtype: Any, lora: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    one._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one, dtype=dtype)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(f"no decoder layers found in {type(model).__name__}")
    layer = layers[0].to_empty(device="cpu")
    if lora is None:
        return layer
    from peft import LoraConfig, inject_adapter_in_model

    targets = [t for t in lora.targets if t != "lm_head"]
    conf = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                      target_modules="all-linear" if targets == ["all-linear"] else targets)
    layer = inject_adapter_in_model(conf, layer)
    for name, param in layer.named_parameters():
        if "lora_" in name:
            param.data = torch.empty(param.shape, dtype=torch.float32)
        param.requires_grad_("lora_" in name)
    return layer


def _measure(config: Any, dtype_name: str, autocast: str | None, lora: Any, masked: bool) -> CompiledLayer:
    import torch
    import torch._inductor.compile_fx as inductor
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from core.dtypes import torch_dtype_name

    dtype = getattr(torch, torch_dtype_name(dtype_name))
    layer = _layer(config, dtype, lora)
    params = {id(p) for p in layer.parameters()}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    seen: dict[str, Any] = {}

    def reader(gm: Any, example_inputs: Any, role: str = "graph") -> Any:
        seen[role] = gm
        values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in gm.graph.output_node().args[0]]

        def run(args: list[Any]) -> list[Any]:
            args.clear()
            return [torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype)
                    if isinstance(v, torch.Tensor) else v for v in values]
        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        seen["fwd_outputs"] = kwargs.get("num_fwd_outputs")
        return inductor.partition_fn(gm, joint_inputs, **kwargs)

    def backend(gm: Any, example_inputs: Any) -> Any:
        seen["inputs"] = example_inputs
        return aot_autograd(fw_compiler=reader, bw_compiler=lambda g, i: reader(g, i, "backward"),
                            decompositions=select_decomp_table(), partition_fn=partition,
                            keep_inference_input_mutations=True)(gm, example_inputs)

    torch._dynamo.reset()
    s = PROBE_TOKENS
    residual = dtype
    x = torch.empty(1, s, int(text.hidden_size), dtype=residual, requires_grad=True)
    cos = torch.empty(1, s, head_dim, dtype=residual)
    sin = torch.empty(1, s, head_dim, dtype=residual)
    kwargs: dict[str, Any] = {"position_embeddings": (cos, sin)}
    if masked:
        kwargs["attention_mask"] = torch.zeros(1, 1, s, s, dtype=getattr(torch, torch_dtype_name(autocast or dtype_name)))
    context = (torch.autocast("cpu", dtype=getattr(torch, torch_dtype_name(autocast)))
               if autocast else contextlib.nullcontext())
    compiled: Any = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    with context:
        out = compiled(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.empty_like(out))
    graph = seen["graph"]
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    inputs = seen["inputs"]
    rows: list[tuple[str, int]] = []
    scaled = {0: 0, 1: 0, 2: 0}  # bytes by how many of the shape's dimensions are the sequence's
    for node in graph.graph.output_node().args[0][seen["fwd_outputs"]:]:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        if node.op == "placeholder":
            given = inputs[placeholders.index(node)] if placeholders.index(node) < len(inputs) else None
            if given is not None and (id(given) in params or given.shape == cos.shape):
                continue  # a parameter, or cos/sin (shared by every layer, counted once in the head)
            what = "the layer's input"
        else:
            what = str(node.target).replace("aten.", "")
        nbytes = value.numel() * value.element_size()
        rows.append((f"{what} {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}", nbytes))
        scaled[min(sum(1 for d in value.shape if d == s), 2)] += nbytes
    torch._dynamo.reset()
    rows.sort(key=lambda r: -r[1])
    return CompiledLayer(scaled[1] / s, tuple(rows), constant=scaled[0], per_token_squared=scaled[2] / (s * s))
