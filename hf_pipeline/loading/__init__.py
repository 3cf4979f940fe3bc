"""Making this rank's stages: the splitter's two front ends, checkpoint reading, the one loader.

Lives here:

- the front ends, both returning a :class:`~.stages.StageMaker`: :mod:`.stages` (the recipe front
  end: pruned copies of the HF model on the meta device, so stage parameter names equal checkpoint
  keys) and :mod:`.trace` (the torch.export front end for models without a recipe), with
  :mod:`.traced_plan` (blocks, costing and stage contents of a traced model) and
  :mod:`.traced_graphs` (the traced graphs' wiring, rewrites and runner);
- the checkpoint: :mod:`.checkpoint_files` (where it is, ``resolve_checkpoint``; which shard holds each
  key, ``CheckpointIndex``; the weight files' names, ``INDEX_NAME``), :mod:`.safetensors_header` (a
  shard's header, checked), :mod:`.key_renames` (transformers' renames on load), :mod:`.key_conversions`
  (tensors transformers merges on load, such as experts stored one tensor each), :mod:`.key_plan` (model
  names against checkpoint keys), :mod:`.weights` (per-stage, shard-by-shard reading) and
  :mod:`.missing_weights` (what the checkpoint lacks, initialised as transformers does);
- :mod:`.loader` (``load_pipeline``: options -> agreement (:mod:`.identity`) -> front end -> wanted
  tensors -> load -> materialise; every entry point loads through it); :mod:`.tensor_parallel` and
  :mod:`.fsdp` (a loaded stage sharded over its mesh's tp or fsdp dim, each rank reading only its part).

May import: the base modules and the rooms below it (``distributed``, ``families``, ``planning``,
``runtime``).
"""
