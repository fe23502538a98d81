"""The online product's stage data plane: a layer slice of the model with LoRA that serves
and trains (:mod:`.stage_model`), the typed messages a stage runs (:mod:`.stage_ops`), a
stage's process (:mod:`.stage_process`), a node's pipeline in stage 0's process
(:mod:`.node_pipeline`) and its wire to the other stages (:mod:`.stage_wire`), the DPO
loss (:mod:`.losses`) and adapters in peft's on-disk format (:mod:`.peft_format`).

It runs the engine's model executor (:mod:`raycolo.engine.executor`) on a layer slice;
the engine imports nothing from here. Pure torch (and peft), no Ray.
"""
