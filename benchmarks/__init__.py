"""Benchmarks side by side: every figure is a ratio against a baseline measured in the same run.

    python -m benchmarks                      # the full run (several minutes), writes bench_results/
    python -m benchmarks --quick              # tiny sizes, every section, seconds (what CI runs),
                                              # writes bench_out/quick/
    python -m benchmarks --sections train,generate   # rerun some sections, merged into results.json
    hf-pipeline bench [same options]          # the same, from anywhere (runs python -m benchmarks of this checkout)

Run ``python -m benchmarks`` from the repository root (``pip install -e .`` first); the host-memory
figures and the random LLaMA configuration come from the developer tools beside it
(:mod:`devtools.host_memory`, :mod:`devtools.llama`).

Sections (multi-rank parts run under ``torchrun``, 1 thread per rank, OMP_NUM_THREADS=1; each
baseline runs in the same invocation):
  load      a >= 1 GB LLaMA-architecture bf16 checkpoint in >= 4 safetensors shards (random weights,
            written shard by shard and cached): per-rank peak RSS above the post-import baseline
            (the OS's high-water mark, VmHWM, reset before each load) and bytes read, for p = 1, 2, 4,
            against transformers ``from_pretrained`` on every rank (what accelerate's prepare_pippy needs);
            each rank's load wall time against plainly reading the same byte ranges (warm and cold).
  train     tokens/s of ``model.train_step`` per schedule on 2 ranks x 1 thread against one
            transformers process x 1 thread, same global batch (LLaMA hidden 384, 12 layers, GQA,
            vocab 8192, seq 128, batch 16, 8 microbatches); and as fractions of the machine's limit,
            measured in the same run: 2 independent transformers processes on half the batch each,
            paid the cost of small microbatches (perfect overlap).
  generate  tokens/s of pipelined greedy ``generate`` (2 ranks) against transformers' ``generate``
            on one process, against a one-microbatch pipeline, and against the 2-way limit
            (2 independent processes on half the prompts each); 16 prompts x 32 tokens, 64 new tokens.
  bubble    per-rank idle fraction of one profiled training step per schedule (from per-action
            timings, hf_pipeline.tools.profile) beside the schedule's theoretical bubble; Gantt PNGs and
            Chrome traces go to ``<out>/timelines/``.

  checkpointing  per-rank peak memory during a ``train_step`` (RSS high-water mark above the resting level)
            and step time, without and with ``activation_checkpointing_enable()``, at seq 1024 on 2 ranks
            (1F1B), beside the memory planner's prediction of live activations + gradients.

  serve     one seeded request stream (mixed prompt and output lengths, Poisson arrivals) through the
            serving Engine (default batching, then static batches) on 2 ranks, transformers' continuous
            batching on one process and transformers' native pipeline (``pp_size``, static batches):
            throughput, p50 / p99 latency, time to first token, each against the served pipeline.

  serve-http  ``guidellm run`` (its CLI, concurrent profile, completions) against real servers on 127.0.0.1:
            ``hf-pipeline serve`` at 2 ranks, one ``transformers serve --continuous-batching`` process, and
            the machine's 2-way limit (two such processes, half the requests each, at once); the bundled tiny
            model and a decode-heavy random LLaMA (hidden 1024, 24 layers); concurrency 1 and 8 (quick: the
            tiny model at 1 and 2). What a GPU run must show: :mod:`benchmarks.serve_http`.

Writes ``<out>/results.md`` (the tables, the command and the machine) and ``<out>/results.json``.
``--out`` defaults to ``bench_results/`` (committed) for full runs and to ``bench_out/quick/`` (ignored
by git) for ``--quick``, whose tiny sizes make numbers that only show the script works.

The package, by job: ``config`` (sizes, schedules, sections), ``checkpoints`` (the random
checkpoints), ``meters`` (peak RSS, page cache, plain reads), ``timing`` (medians, inputs, one
message's hop), ``torch_pipeline`` (the same pipelines without hf_pipeline), ``split_backward``;
one module per section measuring (``load``, ``train``, ``generate``, ``serve``: the tasks each rank runs;
``serve_http``: the servers and guidellm runs), its
results (``<section>_results``: results.json's part) and its tables (``<section>_tables``);
``processes`` (fresh processes per launch), ``run`` (one run), ``report`` (results.md and README's
block, rendered once by ``tables.render``), ``cli`` (the command line).
"""
