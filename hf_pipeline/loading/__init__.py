"""Making this rank's stages: the splitter's two front ends, safetensors reading, the one loader.

Lives here: :mod:`.stages` (the recipe front end: pruned copies of the HF model on the meta
device, so stage parameter names equal checkpoint keys), :mod:`.trace` (the torch.export front
end for models without a recipe), :mod:`.weights` (per-stage, shard-by-shard safetensors reading)
and :mod:`.loader` (options -> front end -> wanted tensors -> load -> materialise; every entry
point loads through it).

May import: the base modules and the rooms below it (``distributed``, ``families``, ``planning``,
``runtime``).
"""
