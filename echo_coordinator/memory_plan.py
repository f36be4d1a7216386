"""How much memory the trainer needs: bytes per trainer rank from the model's shape (its HF
config.json), which `memory_check` compares with the device at start, before any weights load, and
the figures docs/scaling.md tabulates ("The paper's workloads").

What the estimate counts, per rank, at a training step's peak (the backward of the largest
micro-batch starts with every activation saved, the gradients of the micro-batch before it and
AdamW's state alive):
- the weights: LoRA's frozen base in the compute dtype (learner.py: bf16 on a GPU, fp32 on the
  CPU) and its adapters in fp32 (peft keeps them fp32 under a bf16 base); full mode's in fp32 (its
  master weights), with autocast's bf16 copy of them alive through a step's forward and backward;
- gradients and AdamW's two moments in fp32, the trained tensors' dtype (torch's AdamW keeps its
  state in the parameter's dtype, fused or not);
- `sharding = "fsdp"`: all of the above 1/N, plus what FSDP2 gathers, wrapped per decoder layer
  under a root: the root's parameters (embeddings, head, final norm) stay gathered from forward to
  backward, two layers are gathered at a time (the one computing, the one prefetched), and the
  unsharded gradients of the root and of one layer exist before their reduce-scatter;
- `sharding = "none"` with several ranks: the flat buffer `distributed.sum_gradients` all-reduces;
- the activations autograd saves, counted op by op from what transformers' layers save (tested
  against the saved tensors of tiny real models: tests/unit/echo_coordinator/test_memory_plan.py);
- the logits of the scored tokens: at the log-softmax's backward its saved output, the incoming
  gradient and the result, each (tokens, vocabulary) in fp32;
- rank 0 from an HF checkpoint: the verification copy of the model, loaded from the nodes' GGUF in
  the compute dtype (startup.py; never sharded, never stepped, so no optimiser state), which each
  version verified against is loaded into; from a GGUF, the one version nodes hold that
  verification keeps on the device beside the trainer's weights (`TrainerWeights.holding`).
Two other moments can be a sharded rank's peak: loading (every rank loads the whole model, then
shards it: learner.py, trainer/sharded.py) and, with more than one PPO pass, the whole weights
each rank gathers for the start-of-step logprobs.

Not counted: the CUDA context and NCCL's buffers, allocator fragmentation, kernel workspaces, the
verification forward (between steps, smaller than a training step's), host memory. So the figure
is a floor: a run it refuses cannot fit; one it accepts may still run out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30  # GPUs are sold in these: an "80 GB" GPU is 80 GiB, of which the driver reports 79.6
FP32 = 4
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # the learner's
# Bits a weight of the nodes' GGUF: q8_0 is 34 bytes per 32 weights, q4_1 20, f16 2 a weight;
# q4_k_m mixes q4_K and q6_K tensors, about 4.9 (docs/volunteers.md).
QUANT_BITS = {"q4_k_m": 4.9, "q8_0": 8.5, "q4_1": 5.0, "f16": 16.0}
KNOWN_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """What the memory arithmetic needs of a model, read from its config.json."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a dense MLP's width
    tied: bool  # the output head is the embedding matrix
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm on every query and key head
    experts: int = 0
    experts_per_token: int = 0
    expert_width: int = 0  # moe_intermediate_size
    sparse: tuple[bool, ...] = ()  # per layer: a mixture-of-experts MLP

    @classmethod
    def from_config(cls, config: dict) -> ModelShape | None:
        """The shape of an HF config of a supported architecture; None for any other."""
        kind = config.get("model_type", "")
        if kind not in KNOWN_TYPES:
            return None
        heads, hidden, layers = config["num_attention_heads"], config["hidden_size"], config["num_hidden_layers"]
        # Qwen's published configs say num_experts; transformers 5 writes num_local_experts.
        experts = (config.get("num_experts") or config.get("num_local_experts") or 0) if kind == "qwen3_moe" else 0
        step, dense_only = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers", []))
        bias = config.get("attention_bias", False)
        return cls(
            model_type=kind, vocab=config["vocab_size"], hidden=hidden, layers=layers, heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads, intermediate=config["intermediate_size"],
            tied=config.get("tie_word_embeddings", False),
            qkv_bias=True if kind == "qwen2" else bias,  # Qwen2's q/k/v always carry biases
            o_bias=bias and kind != "qwen2", mlp_bias=kind == "llama" and config.get("mlp_bias", False),
            qk_norm=kind in ("qwen3", "qwen3_moe"), experts=experts,
            experts_per_token=config.get("num_experts_per_tok", 0) if experts else 0,
            expert_width=config.get("moe_intermediate_size", 0) if experts else 0,
            sparse=tuple(experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers)),
        )

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_parameters(self, i: int) -> int:
        h, q, kv = self.hidden, self.q, self.kv
        attention = h * (q + 2 * kv) + q * h + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        attention += self.qk_norm * 2 * self.head_dim
        if self.sparse and self.sparse[i]:
            mlp = self.experts * 3 * h * self.expert_width + self.experts * h  # experts + router
        else:
            mlp = 3 * h * self.intermediate + self.mlp_bias * (2 * self.intermediate + h)
        return attention + mlp + 2 * h  # two RMSNorms

    def root_parameters(self) -> int:
        """Outside the decoder layers: embeddings, the head (unless tied), the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def parameters(self) -> int:
        return self.root_parameters() + sum(self.layer_parameters(i) for i in range(self.layers))

    def expert_parameters(self) -> int:
        return sum(self.sparse) * self.experts * 3 * self.hidden * self.expert_width

    def lora_parameters(self, rank: int) -> int:
        """What peft trains with the learner's targets: r × (in + out) per linear layer; a mixture's
        fused expert tensors get one pair per expert, rank 2r for gate_up (gate and up in one). A
        dense MLP among a mixture's layers (`mlp_only_layers`) gets its adapters as in any model
        (from peft 0.22, the floor: `engines.hf.FLOORS`)."""
        h, q, kv = self.hidden, self.q, self.kv
        attention = rank * ((h + q) + 2 * (h + kv) + (q + h))
        total = 0
        for i in range(self.layers):
            if self.sparse and self.sparse[i]:
                width = self.expert_width
                mlp = self.experts * (2 * rank * (h + 2 * width) + rank * (width + h))
            else:
                mlp = rank * 3 * (h + self.intermediate)
            total += attention + mlp
        return total

    def layer_activations(self, sparse: bool, weight_bytes: int, lora_rank: int | None) -> tuple[int, int]:
        """(bytes per token, bytes per layer independent of tokens) autograd saves in one decoder
        layer whose input needs a gradient; `lora_rank` None: full fine-tuning. Op by op, as
        transformers 5 computes them (RMSNorm upcasts to fp32; SDPA saves q, k, v, its output and
        an fp32 log-sum-exp per head; peft casts a bf16 input to fp32 for each adapter it feeds)."""
        w, lora, r = weight_bytes, lora_rank is not None, lora_rank or 0
        h, q, kv, heads, kv_heads = self.hidden, self.q, self.kv, self.heads, self.kv_heads

        def norm(n: int, vectors: int) -> int:
            # The input in fp32 and one rsqrt per vector; the normalised input only if the norm's
            # weight is trained (its gradient needs it).
            return FP32 * n + FP32 * vectors + (0 if lora else w * n)

        def fed(n: int, consumers: int, shared: bool = False) -> int:
            # What `consumers` linear layers save of their one input (`shared`: another op saved it
            # already). Full mode: the input, once. LoRA: each adapter's fp32 input (in fp32 the input
            # itself, once; under bf16 a cast copy per adapter) and its rank-r middle.
            once = 0 if shared else (FP32 if lora else w) * n
            if not lora:
                return once
            return (once if w == FP32 else consumers * FP32 * n) + consumers * FP32 * r

        per_token = norm(h, 1) + fed(h, 3)
        if self.qk_norm:  # RoPE after the norm saves nothing of its input
            per_token += norm(q, heads) + norm(kv, kv_heads)
        per_token += w * (2 * q + 2 * kv) + FP32 * heads + fed(q, 1, shared=True)  # SDPA; o_proj reads its output
        per_token += norm(h, 1)
        per_layer = 0
        if sparse:
            e, k, width = self.experts, self.experts_per_token, self.expert_width
            per_layer = 4 * e  # which experts the tokens hit, one 4-byte count each
            per_token += 0 if lora else w * h  # the router's input (a frozen router saves none)
            per_token += FP32 * e  # the router's softmax, in fp32
            # Per routed token: its gathered input, gate_up's output, the activation, the product
            # down_proj reads, down_proj's output and routing weight, and 32 bytes of indices.
            per_token += k * (w * (2 * h + 4 * width + 1) + 32)
            if lora:  # peft folds each expert tensor's adapter into a whole new (E, out, in) weight per forward
                per_layer += w * e * 3 * h * width + (0 if w == FP32 else w * e * r * (5 * width + 3 * h))
        else:
            # gate_proj and up_proj read the norm; the activation, the product and down_proj's input
            per_token += fed(h, 2) + 3 * w * self.intermediate + fed(self.intermediate, 1)
        return per_token, per_layer


@dataclass(frozen=True)
class Setup:
    """How the trainer runs: what `[run] update`, `[trainer]` and the device decide."""

    update: str  # "lora" or "full"
    lora_rank: int
    sharding: str  # "none" or "fsdp"
    ranks: int  # trainer processes over all machines
    weight_bytes: int  # the compute dtype's: 2 (bf16, a GPU) or 4 (fp32, the CPU)
    tokens: int  # padded tokens of the largest micro-batch
    checkpointing: bool  # activation checkpointing per decoder layer
    verification_copy: bool  # rank 0 also holds the model the nodes run (an HF checkpoint base)
    # Sharded: before a step with ppo_epochs × ppo_minibatches > 1, every rank gathers the whole
    # weights for the start-of-step logprobs (`sharded.gather`), beside its shards.
    gathers_whole: bool = False


@dataclass(frozen=True)
class Plan:
    """Bytes per rank, by part and phase; `verification` only on rank 0."""

    weights: int  # base weights plus LoRA adapters (this rank's shard of them)
    gradients: int
    optimizer: int
    gathered: int  # FSDP during a step: unsharded parameters and gradients in flight
    cast: int  # unsharded full mode under bf16 compute: autocast's bf16 copy of the fp32 weights, in a step
    activations: int
    logits: int
    all_reduce: int  # data parallel, after the backward: the flat gradient buffer
    whole: int  # FSDP, `gathers_whole`: the whole weights gathered before the step
    loading: int  # FSDP: every rank loads the whole model before sharding it
    verification: int

    @property
    def held(self) -> int:
        """What a rank keeps from step to step."""
        return self.weights + self.gradients + self.optimizer

    @property
    def per_rank(self) -> int:
        """The peak of a rank other than 0: the step's backward, the all-reduce after it, a whole
        gather before it, or loading."""
        step = self.gathered + self.cast + self.activations + self.logits
        return max(self.held + max(step, self.all_reduce, self.whole), self.loading)

    @property
    def rank0(self) -> int:
        step = self.gathered + self.cast + self.activations + self.logits
        return max(self.held + self.verification + max(step, self.all_reduce, self.whole), self.loading)

    def parts(self) -> str:
        named = [("weights", self.weights), ("gradients", self.gradients), ("AdamW", self.optimizer),
                 ("FSDP gathers", self.gathered), ("bf16 copy", self.cast), ("activations", self.activations),
                 ("logits", self.logits),
                 ("all-reduce buffer", self.all_reduce), ("whole-weights gather", self.whole),
                 ("verification (rank 0)", self.verification)]
        return ", ".join(f"{name} {gib(b)}" for name, b in named if b)


def plan(shape: ModelShape, setup: Setup) -> Plan:
    w, n = setup.weight_bytes, setup.ranks
    lora = setup.update == "lora"
    params = shape.parameters()
    trained = shape.lora_parameters(setup.lora_rank) if lora else params
    trained_bytes = FP32  # AdamW steps fp32 tensors: adapters, or full mode's master weights
    whole = params * w + trained * FP32 if lora else params * FP32
    weights, gradients, optimizer = whole, trained * trained_bytes, 2 * trained * trained_bytes
    gathered = all_reduce = loading = 0
    cast = params * w if not lora and w < FP32 and setup.sharding != "fsdp" else 0  # saved for backward
    if setup.sharding == "fsdp":
        weights, gradients, optimizer = (math.ceil(b / n) for b in (weights, gradients, optimizer))
        largest = max(shape.layer_parameters(i) for i in range(shape.layers))
        gathered = (shape.root_parameters() + 2 * largest) * w  # in the compute dtype (MixedPrecisionPolicy)
        if not lora:
            # unsharded gradients before reduce-scatter, and in fp32 too where they are computed in bf16
            gathered += (shape.root_parameters() + largest) * (w + (FP32 if w < FP32 else 0))
        loading = whole
    elif n > 1:
        all_reduce = trained * trained_bytes
    rank = setup.lora_rank if lora else None
    layers = [shape.layer_activations(bool(shape.sparse and shape.sparse[i]), w, rank) for i in range(shape.layers)]
    if setup.checkpointing:  # each layer keeps its input; one layer's activations exist while it recomputes
        per_token, constant = max(t for t, _ in layers), max(c for _, c in layers)
        activations = setup.tokens * (shape.layers * w * shape.hidden + per_token) + constant
    else:
        activations = sum(setup.tokens * t + c for t, c in layers)
    logits = 3 * FP32 * setup.tokens * shape.vocab
    held = trained * FP32 if lora else params * w  # one version of what nodes hold, for verification
    return Plan(weights, gradients, optimizer, gathered, cast, activations, logits, all_reduce,
                whole if setup.sharding == "fsdp" and setup.gathers_whole else 0, loading,
                params * w + (held if lora else 0) if setup.verification_copy else held)


def gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def needed(shape: ModelShape, setup: Setup, sharing: int = 1) -> int:
    """The bytes that must fit in one device: rank 0's, plus those of the other ranks sharing it."""
    p = plan(shape, setup)
    return p.rank0 + (sharing - 1) * p.per_rank


# What a volunteer needs (docs/volunteers.md, "Memory").

def gguf_bytes(shape: ModelShape, quant: str) -> float:
    """The nodes' GGUF: every weight at the quant's bits (a tied head is stored once)."""
    return shape.parameters() * QUANT_BITS[quant] / 8


def kv_cache_bytes(shape: ModelShape, parallel: int = 8, window: int = 2048) -> int:
    """llama.cpp's KV cache as a node keeps it: fp32, `parallel` full windows."""
    return parallel * window * shape.layers * 2 * shape.kv * FP32
