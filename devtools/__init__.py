"""Developer tooling: what the project's developers run from a source checkout, never shipped in the wheel.

Run each from the repository root (``pip install -e .`` first), as a module:

    python -m devtools.device_check --device cpu --size tiny       # the CUDA path check (see the package)
    python -m devtools.load_test --url http://127.0.0.1:8000/v1 --model default-model --requests 200
    python -m devtools.house_figures [OTHER_TREE]                  # how far a tree is from the house rules
    torchrun --nproc_per_node 2 -m devtools.make_default_model --out hf_pipeline/assets/default-model

Lives here: ``device_check`` (the device check, a package: its run, sections and sizes / tolerances),
``load_test`` (a load generator for any OpenAI-compatible server), ``house_figures`` (module and
function sizes, builtin raises, private API uses and ruff of a tree), ``make_default_model`` (trains
the bundled models) with ``docstring_corpus`` (its training text and tokenizers) and ``model_cards``
(their README.md), and the helpers the tools and ``benchmarks/`` share: ``host_memory`` (resident
memory and its high-water mark), ``llama`` (the random LLaMA configuration) and ``collectives``
(object collectives that work with or without ``torchrun``).

What it may import: ``hf_pipeline`` and its dependencies, and its own modules. ``benchmarks/`` imports
the shared helpers from here; nothing in ``hf_pipeline`` imports ``devtools``, and the user scripts in
``scripts/`` do not either.
"""
