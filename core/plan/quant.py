"""Bytes of bitsandbytes' quantised layouts of a base model: 4-bit weights (QLoRA's base).

These are the variants' own memory lines, exact where the layout is fixed. Each formula is read from bitsandbytes 0.50.2
(the version pinned in constraints.txt) and checked to the byte against the live tensors on this CPU
(tests/unit/test_quant.py):

4-bit weights (``bitsandbytes/_ops.py``, the ``quantize_4bit`` fake kernel; ``functional.quantize_4bit``), for a
weight of ``n`` elements quantised in blocks of ``blocksize`` (64 unless given; transformers' ``BitsAndBytesConfig``
does not change it):

- packed weight: ``(n + 1) // 2`` bytes (two 4-bit codes per ``uint8``; ``bnb_4bit_quant_storage`` uint8);
- per-block constants (``QuantState``), with ``blocks = ceil(n / blocksize)``:
  - plain: ``absmax`` fp32 per block (``4 * blocks``) and the 16-entry fp32 code table of the quant type (64 B);
  - double quantisation (``compress_statistics=True``): ``absmax`` itself quantised to ``uint8`` in blocks of 256
    (``blocks`` bytes), its own fp32 ``absmax`` (``4 * ceil(blocks / 256)``), the 256-entry fp32 dynamic map of the
    second level (1,024 B), the fp32 ``offset`` (4 B), and the 16-entry code table (64 B).
  Every quantised layer has its own code tables (measured: none is shared between layers).

bitsandbytes' 8-bit and paged optimizer states are the optimizers' own (core/optim/bnb.py).

QLoRA's base over the model as it runs (:func:`quantised_base`, :class:`QuantisedBase`): every decoder linear weight
in 4 bits, every other parameter in its dtype, the adapters fp32; on the CPU, the checkpoint's pages of the quantised
layers as they load (:func:`quantised_source_bytes`).

Nothing here imports torch or bitsandbytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from core.dtypes import dtype_bytes, dtype_name
from core.errors import SpecError
from core.optim.bnb import DYNAMIC_MAP_ENTRIES
from core.plan.activations import LLAMA_FAMILY
from core.plan.meta import ModelShape, ModelSummary, ParamInfo
from core.spec import RunSpec

#: bitsandbytes' default 4-bit block size (``quantize_4bit``: ``blocksize = 64`` when none is given)
BLOCKSIZE_4BIT = 64
#: double quantisation quantises the fp32 absmax values in blocks of this many (``quantize_blockwise(..., blocksize=256)``)
NESTED_BLOCKSIZE = 256
#: entries of a 4-bit code table (NF4 or FP4), fp32
CODE_4BIT_ENTRIES = 16
FP32 = 4

QuantType = Literal["nf4", "fp4"]


def _blocks(n: int, size: int) -> int:
    return -(n // -size)


@dataclass(frozen=True)
class Quantised4bit:
    """The bytes of one weight of ``numel`` elements stored in 4 bits by bitsandbytes.

    Attributes:
        packed_bytes: the packed ``uint8`` weight, ``(numel + 1) // 2``.
        constants_bytes: the per-block constants and code tables (:func:`quantised_4bit`).
    """

    packed_bytes: int
    constants_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.packed_bytes + self.constants_bytes


def quantised_4bit(numel: int, double_quant: bool, blocksize: int = BLOCKSIZE_4BIT) -> Quantised4bit:
    """Bytes of one weight of ``numel`` elements quantised to 4 bits (NF4 and FP4 alike; module docstring for the source).

    Args:
        numel: elements of the weight (``out_features * in_features``), >= 1.
        double_quant: ``bnb_4bit_use_double_quant`` (bitsandbytes' ``compress_statistics``).
        blocksize: elements per block of the first level.

    Raises:
        ValueError: ``numel`` < 1 or ``blocksize`` < 1.
    """
    if numel < 1 or blocksize < 1:
        raise ValueError(f"quantised_4bit: numel ({numel}) and blocksize ({blocksize}) must be at least 1")
    blocks = _blocks(numel, blocksize)
    code = CODE_4BIT_ENTRIES * FP32
    if double_quant:
        constants = blocks + FP32 * _blocks(blocks, NESTED_BLOCKSIZE) + DYNAMIC_MAP_ENTRIES * FP32 + FP32 + code
    else:
        constants = FP32 * blocks + code
    return Quantised4bit(packed_bytes=(numel + 1) // 2, constants_bytes=constants)


def dequantised_bytes(numel: int, compute_bytes: int, double_quant: bool, blocksize: int = BLOCKSIZE_4BIT) -> int:
    """Bytes a 4-bit layer makes each time it runs (forward, and backward for the gradient of its input): its weight
    dequantised to the compute dtype (``numel x compute_bytes``; ``dequantize_4bit``, in ``gemm_4bit``'s default
    kernel and ``MatMul4Bit.backward``), and with double quantisation the fp32 absmax of every block, dequantised first
    (``4 x ceil(numel / blocksize)``). Measured to the byte on this CPU (tests/unit/test_quant.py); bitsandbytes' CUDA
    kernel for a forward of at most ~1,536 tokens dequantises inside the kernel, so on CUDA this is an upper bound.
    """
    return numel * compute_bytes + (FP32 * _blocks(numel, blocksize) if double_quant else 0)


# ---------------------------------------------------------------------------------------------------- QLoRA's base
@dataclass(frozen=True)
class QuantisedBase:
    """QLoRA's weights, part by part (bytes; the module docstring for each layout and its source).

    Attributes:
        quant_type: ``nf4`` or ``fp4``; double_quant: whether the absmax constants are quantised too.
        layers: the linear layers stored in 4 bits (every decoder linear; not the embeddings, norms or LM head).
        quantised_parameters: their elements.
        packed_bytes: the packed 4-bit weights, 0.5 B per element.
        constants_bytes: their per-block absmax constants and code tables.
        unquantised_bytes: every other base parameter (embeddings, norms, LM head, biases) in its dtype.
        adapter_bytes: the LoRA adapters (fp32).
        dequantised_bytes: the largest layer's weight dequantised to the compute dtype as it runs (a temporary).
    """

    quant_type: str
    double_quant: bool
    layers: int
    quantised_parameters: int
    packed_bytes: int
    constants_bytes: int
    unquantised_bytes: int
    adapter_bytes: int
    dequantised_bytes: int

    @property
    def quantised_bytes(self) -> int:
        """The 4-bit weights as stored: packed weights and their constants."""
        return self.packed_bytes + self.constants_bytes

    @property
    def weights_bytes(self) -> int:
        """Every weight the model holds: the 4-bit ones, the rest in their dtype, and the adapters."""
        return self.quantised_bytes + self.unquantised_bytes + self.adapter_bytes


#: the families whose decoder layers' projections are all ``nn.Linear`` (or a subclass: Falcon's ``FalconLinear``), which
#: transformers' bitsandbytes integration quantises (``replace_with_bnb_linear``: ``isinstance(module, nn.Linear)``),
#: checked on each family's model built on the meta device (tests/unit/test_quant.py): QLoRA is planned for these
#: (GPT-2's ``Conv1D`` layers, for one, are not)
QLORA_FAMILIES = (*LLAMA_FAMILY, "gemma", "gemma2", "phi", "phi3", "falcon", "gpt_neox")


def _is_quantised(p: ParamInfo) -> bool:
    """A weight transformers stores in 4 bits under ``load_in_4bit``: a decoder layer's linear weight (its bias, the
    embeddings, norms and the LM head are kept: ``get_keys_to_not_convert`` keeps the output embedding)."""
    return p.kind == "linear" and p.unit == "layer" and len(p.shape) == 2


#: bytes of LLM.int8's per-row scale (``SCB``: one fp32 absmax per output row, bitsandbytes ``Int8Params._quantize``)
INT8_ROW_SCALE = 4


def quantised_base(spec: RunSpec, shape: ModelShape, summary: ModelSummary) -> QuantisedBase:
    """A quantised base's weights part by part (:class:`QuantisedBase`), from each parameter of the model as it runs:
    QLoRA's 4-bit layers, or LLM.int8's 8-bit ones (:func:`int8_base`).

    Raises:
        SpecError: the model is not of a family whose layers this plan knows to be ``nn.Linear``.
    """
    if shape.family not in QLORA_FAMILIES:
        raise SpecError("mode", f"{spec.mode} is planned for the {', '.join(QLORA_FAMILIES)} families in this version, "
                                f"not {shape.family or 'this model'}: use mode lora, or a model of those families")
    if spec.method.quantised == "int8":
        return int8_base(spec, summary)
    dq = spec.qlora.double_quant
    packed = constants = unquantised = adapters = dequantised = layers = numel = 0
    for p in summary.params:
        if p.kind == "adapter":
            adapters += p.numel * dtype_bytes(p.dtype)
        elif _is_quantised(p):
            q = quantised_4bit(p.numel, dq)
            packed, constants, layers, numel = packed + q.packed_bytes, constants + q.constants_bytes, layers + 1, \
                numel + p.numel
            dequantised = max(dequantised, dequantised_bytes(p.numel, spec.dtype_bytes, dq))
        else:
            unquantised += p.numel * dtype_bytes(p.dtype)
    return QuantisedBase(spec.qlora.quant_type, dq, layers, numel, packed, constants, unquantised, adapters,
                         dequantised)


def int8_base(spec: RunSpec, summary: ModelSummary) -> QuantisedBase:
    """LLM.int8's base (Dettmers et al. 2022, arXiv 2208.07339; transformers' ``load_in_8bit``, bitsandbytes
    ``Linear8bitLt`` with ``has_fp16_weights=False``): every decoder linear weight stored as int8, ``out x in`` bytes,
    with an fp32 absmax per output row (``SCB``, ``Int8Params._quantize``); the embeddings, norms and the LM head kept
    in the model's dtype (``get_keys_to_not_convert`` keeps the output embedding). The backward dequantises each
    layer's whole weight to the compute dtype for its input's gradient (``MatMul8bitLt.backward``: ``CB.to(dtype) *
    SCB / 127``, measured on this CPU): the largest layer's at a time."""
    packed = constants = unquantised = adapters = dequantised = layers = numel = 0
    for p in summary.params:
        if p.kind == "adapter":
            adapters += p.numel * dtype_bytes(p.dtype)
        elif _is_quantised(p):
            packed, constants = packed + p.numel, constants + INT8_ROW_SCALE * p.shape[0]
            layers, numel = layers + 1, numel + p.numel
            dequantised = max(dequantised, p.numel * spec.dtype_bytes)
        else:
            unquantised += p.numel * dtype_bytes(p.dtype)
    return QuantisedBase("int8", False, layers, numel, packed, constants, unquantised, adapters, dequantised)


def quantised_source_bytes(spec: RunSpec, config: Any, quantised: QuantisedBase | None) -> tuple[int, str]:
    """QLoRA on the CPU: the checkpoint's pages of the layers quantised as they load (their elements x the bytes of
    the dtype config.json says the checkpoint holds, else the spec's), and that dtype's name; (0, "") otherwise."""
    if quantised is None:
        return 0, ""
    raw = getattr(config, "raw", None)
    stated = (raw.get("dtype") or raw.get("torch_dtype")) if isinstance(raw, dict) else (
        getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    name = dtype_name(stated) if stated else spec.dtype
    try:
        nbytes = dtype_bytes(name)
    except ValueError:
        name, nbytes = spec.dtype, spec.dtype_bytes
    return quantised.quantised_parameters * nbytes, name
