"""A LoRA training cell on a model the notebook holds (issue 44: only the adapters have gradients and AdamW state
on the ranks, and the notebook gets the adapters back, not the base).

Each size is a fresh kernel (``NBFSDP_PREWARM=0``, CPU ranks, world size 2) whose world is up before the model
is built. The notebook builds a Llama-shaped model from a config with real weights in bf16 (246M parameters:
hidden 1024, 16 layers, vocabulary 32000, grouped-query attention, untied head) and wraps it with
``peft.get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))`` (fp32 adapters). A first
cell sends the shards and makes ``opt = AdamW`` over the trainable parameters on the ranks (it comes back to the
notebook bound to the model, and later cells find it on the ranks: nothing is sent again). Then one LoRA
training step on 2 x 64 tokens a rank, under ``--no-gather`` (A: nothing comes back) and gathering (B: the
adapters come back), alternating, each side first in turn:

- B / A: the gathering cell's median kernel round trip over ``--no-gather``'s; target at most 1.1 (bringing
  the adapters back costs what ``--no-gather`` costs);
- the bytes that came back into the model after each B cell (``nbfsdp.last_run().gathered_bytes``) against
  the adapters' bytes: equal, to the byte (target: 0 bytes more or fewer); and as a share of the whole model's;
- for the record, once, the same step followed by a write to every parameter (``p.add_(0)`` under
  ``no_grad``), so the whole model comes back: what every LoRA cell cost before issue 44, over A.

``--quick``: a 2-layer model of hidden 256 and a vocabulary of 1,024 (1.9M parameters), fewer cells: on a CPU
without bf16 instructions (AVX2 only) its bf16 head over 32,000 tokens took each quick cell seconds. Run alone:
``python -m benchmarks --only lora_cell``.
"""

from __future__ import annotations

from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, in_turn, median, round_interval

NAME = "lora_cell"
RATIO_TARGET = 1.1
MiB = 2**20
#: name -> (hidden, intermediate, layers, heads, kv heads, vocabulary)
SIZES = {"246M": (1024, 2816, 16, 16, 4, 32000)}
QUICK_SIZES = {"tiny": (256, 688, 2, 8, 2, 1024)}
#: Tokens a rank trains on in a step: (batch, sequence).
BATCH = (2, 64)

SETUP = """%load_ext nbfsdp
import gc, json, torch, transformers, peft, nbfsdp
"""
BUILD = """config = transformers.LlamaConfig(
    vocab_size={vocab}, hidden_size={hidden}, intermediate_size={intermediate}, num_hidden_layers={layers},
    num_attention_heads={heads}, num_key_value_heads={kv}, max_position_embeddings=256)
torch.manual_seed(0)
base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model = peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
del base
gc.collect()
"""
#: What the notebook's model holds: its parameters' count, its adapters' bytes and the whole state's (each tensor
#: once, as ``gathered_bytes`` counts them).
SIZES_OF = """print(json.dumps({
    "params": sum(p.numel() for p in model.parameters()),
    "adapter_bytes": sum(p.nbytes for p in model.parameters() if p.requires_grad),
    "model_bytes": sum({id(t): t.nbytes for t in model.state_dict().values()}.values()),
}))"""
FIRST = """%%fsdp --world-size 2
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
"""
STEP = """%%fsdp --world-size 2{flags}
tokens = torch.randint(0, {vocab}, {batch}, generator=torch.Generator().manual_seed(rank))
loss = model(input_ids=tokens, labels=tokens).loss
loss.backward()
opt.step()
opt.zero_grad()
"""
#: Appended to the gathering step: every parameter written, so the whole model comes back.
WRITE_ALL = """with torch.no_grad():
    [p.add_(0) for p in model.parameters()]
"""
GATHERED = 'print(json.dumps(nbfsdp.last_run().gathered_bytes.get("model", 0)))'


def one_size(ctx: Context, size: tuple, samples: int) -> dict:
    hidden, intermediate, layers, heads, kv, vocab = size
    kernel = Kernel(env={**NO_PREWARM, **CPU_ONLY})
    try:
        kernel.execute(SETUP)
        kernel.execute("%%fsdp --world-size 2\nready = 1")  # the world up, with no model
        build = BUILD.format(
            vocab=vocab, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads, kv=kv
        )  # fmt: skip
        kernel.execute(build, timeout=900)
        found = kernel.execute(SIZES_OF).json()
        first = kernel.execute(FIRST, timeout=900).elapsed  # the shards sent, the optimizer made on the ranks
        no_gather = STEP.format(flags=" --no-gather", vocab=vocab, batch=BATCH)
        gathering = STEP.format(flags="", vocab=vocab, batch=BATCH)
        a: list[float] = []
        b: list[float] = []
        gathered: list[int] = []

        def cell_a() -> None:
            a.append(kernel.execute(no_gather, timeout=900).elapsed * 1000)

        def cell_b() -> None:
            b.append(kernel.execute(gathering, timeout=900).elapsed * 1000)
            gathered.append(kernel.execute(GATHERED).json())

        for index in range(samples):
            for cell in in_turn(cell_a, cell_b, index):
                cell()
        whole = kernel.execute(gathering + WRITE_ALL, timeout=900).elapsed * 1000
        whole_gathered = kernel.execute(GATHERED).json()
    finally:
        ctx.shutdown(kernel)
    return {
        **found,
        "size": dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"), size, strict=True)),
        "tokens_per_rank": list(BATCH),
        "first_cell_ms": first * 1000,
        "a": a,
        "b": b,
        "gathered_bytes_b": gathered,
        "write_all_ms": whole,
        "write_all_gathered_bytes": whole_gathered,
    }


def rows(found: dict, label: str) -> list[Measurement]:
    a, b, adapters, model = found["a"], found["b"], found["adapter_bytes"], found["model_bytes"]
    gathered = found["gathered_bytes_b"]
    exact = all(g == adapters for g in gathered)
    worst = max(gathered, key=lambda g: abs(g - adapters))
    steps = f"{found['tokens_per_rank'][0]} x {found['tokens_per_rank'][1]} tokens a rank"
    return [
        Measurement(
            what=f"LoRA training cell gathering / the same cell with --no-gather, {label}, {steps}, 2 CPU ranks",
            value=median(b) / median(a),
            unit="x",
            target=RATIO_TARGET,
            op="<=",
            a_label="--no-gather",
            a=median(a),
            b_label="adapters back",
            b=median(b),
            ab_unit="ms",
            samples_a=a,
            samples_b=b,
            interval=round_interval(a, b, lambda x, y: median(y) / median(x)),
        ),
        Measurement(
            what=f"bytes back into the model after a LoRA cell other than the adapters' (more or fewer), {label}",
            value=abs(worst - adapters),
            unit="bytes",
            target=0,
            op="<=",
            a_label="adapters",
            a=adapters / MiB,
            b_label="gathered",
            b=worst / MiB,
            ab_unit="MiB",
            note=f"{adapters:,} bytes of adapters; every one of {len(gathered)} cells "
            + ("brought back exactly those" if exact else f"did not: {gathered}"),
        ),
        Measurement(
            what=f"bytes back into the model after a LoRA cell / the whole model's, {label}",
            value=100 * worst / model,
            unit="%",
            a_label="whole model",
            a=model / MiB,
            b_label="gathered",
            b=worst / MiB,
            ab_unit="MiB",
        ),
        Measurement(
            what=f"the LoRA step writing every parameter too (the whole model back, as every LoRA cell before "
            f"issue 44) / --no-gather, {label}, once",
            value=found["write_all_ms"] / median(a),
            unit="x",
            a_label="--no-gather LoRA cell",
            a=median(a),
            b_label="whole model back",
            b=found["write_all_ms"],
            ab_unit="ms",
            note=f"it brought back {found['write_all_gathered_bytes']:,} bytes, the whole model's {model:,}",
        ),
    ]


def run(ctx: Context) -> dict:
    samples = 3 if ctx.quick else 12
    measurements: list[Measurement] = []
    sizes: dict[str, dict] = {}
    for name, size in (QUICK_SIZES if ctx.quick else SIZES).items():
        found = one_size(ctx, size, samples)
        label = f"{found['params'] / 1e6:,.1f}M parameters (bf16 base, fp32 adapters)"
        sizes[name] = found
        measurements += rows(found, label)
    return {"measurements": measurements, "sizes": sizes}
