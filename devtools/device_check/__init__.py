"""Device check: the CUDA path on whatever GPUs this machine has, in one command, under 5 minutes.

Run from the repository root:

    python -m devtools.device_check                                    # one GPU: 2 stages in one process on cuda:0
    torchrun --nproc_per_node $(nvidia-smi -L | wc -l) -m devtools.device_check   # several GPUs: a rank per GPU, NCCL
    python -m devtools.device_check --device cpu --size tiny           # the same code on CPU (what the tests run)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m devtools.device_check --device cpu --size tiny   # 2 gloo ranks

It builds its own model (nothing is downloaded): a random-weight LLaMA (``--size large``: the
Llama-3.2-1B shape untied, 1.5B parameters, 3 GB in bf16; ``small``: 0.2B; ``tiny``: 3M) saved by
``save_pretrained(max_shard_size=...)`` as a sharded safetensors checkpoint, then runs, section by
section (each one timed, its failure recorded and the next section run anyway):

  env         torch / transformers / CUDA versions, GPUs, world size.
  checkpoint  the random model, written by rank 0 (on the GPU when there is one: init is instant).
  load        ``AutoModelForCausalLM.from_pretrained(path, pipeline=True)`` straight to the device:
              per rank the host peak RSS (VmHWM, reset before the load), the device memory it
              allocated, each stage's parameter bytes and the bytes read, all against the plan's
              stage bytes. On CUDA the host must stay far below the stage bytes (the loader goes
              through a 16 MiB pinned bounce buffer), on CPU it is ~1x (the weights live there).
  reference   transformers ``from_pretrained`` of the same checkpoint on rank 0's device (on
              several GPUs: cuda:0, beside stage 0): the one-GPU baseline.
  forward     pipelined logits against transformers', same inputs (left padded), same device and
              dtype; max |diff| within the tolerance below.
  generate    greedy pipelined ``generate`` against transformers' ``generate(do_sample=False)``:
              tokens equal (see the tolerance), and tokens/s of both.
  train       one ``model.train_step`` against transformers' forward + backward on the same batch:
              loss and gradients (of rank 0's stages) within tolerance, and tokens/s of both; on
              several ranks also each stage's device time per microbatch and the split balanced on
              it (``model.measure_split``), and one profiled step split into the ranks' imbalance,
              the schedule's own bubble (the step replayed with free messages) and the waits
              around the messages.

Tolerances. fp32: the pipeline runs transformers' own modules, so it can differ only by the order
of floating point sums (other batch shapes pick other kernels); fp32 keeps 24 bits, so logits agree
to 1e-4 of the largest logit and greedy tokens must be equal. bf16 keeps 8 bits: a different
summation order alone moves a logit by a few bf16 steps, and a deep residual stream adds these up,
so no fixed number is right for every model. The check measures it instead: transformers in bf16
is compared with the same model in fp32 on the same inputs, and the pipeline in bf16 may differ
from transformers in bf16 by at most twice that rounding error (if both are within it of the fp32
result, they are within twice it of each other), and by at least one bf16 step of the largest
logit (2**-7 of it). Greedy tokens: equal, or a row first differs where transformers' own top two
logits are within that tolerance of each other (a tie that bf16 cannot decide). Loss: 1e-5
relative in fp32, 2**-7 in bf16 (one bf16 step of the loss). Gradients: global relative L2 error
1e-4 in fp32, 2**-4 in bf16; a real bug (a microbatch, stage or tied copy missing) is off by 25% or
more, bf16 rounding by about 1%.

Everything goes to ``--out`` (default ``$OUT/device_check.json`` when ``$OUT`` is set, else
``device_check.json``), rewritten after every section, so a run cut short still leaves its figures.
``--budget-s`` is a hard limit: a section is not started without ``--reserve-s`` left, and at the
budget a watchdog writes the JSON (the running section marked "timed_out") and ends the process.
Exit status 0 when every section ran and passed its checks, 1 otherwise.

Lives here: ``run`` (:class:`~devtools.device_check.run.Run`: the sections in order under the time
budget, the JSON, the watchdog; ``main``), ``sections`` (one method per section, its figures and
checks), ``support`` (the sizes, the tolerances by dtype, timing, the inputs, the comparison of two
greedy generations) and ``__main__`` (``python -m devtools.device_check``). It may import
``hf_pipeline``, torch, transformers and ``devtools``' shared helpers; nothing in ``hf_pipeline``
imports it.
"""
