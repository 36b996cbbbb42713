"""Checkpoint conversion (the library behind tools/convert_checkpoint.py), Megatron's tools/checkpoint.

A conversion streams the model through a canonical form, one *unit* at a time:

    embedding   {"embedding.word_embeddings.weight": [vocab, h], "embedding.position_embeddings.weight"?}
    layer i     {"input_layernorm.weight": ..., "self_attention.linear_qkv.weight": ..., ...}
    head        {"decoder.final_layernorm.weight": ..., "output_layer.weight"? (untied only)}

Canonical tensors carry Megatron-Core's names and layouts (per-group QKV, [gate; up]),
unsplit (TP=1) and with the real, unpadded vocabulary. A loader (``hf``, ``parallel3d``)
produces units from its files, a saver consumes them and writes its files straight to
disk, so no more than one unit is held in memory at a time.

Modules: ``schema`` (what each unit holds for a TransformerConfig), ``hf`` (Hugging Face
GPT-2 / LLaMA), ``parallel3d_format`` (our sharded checkpoints); files are written by
``parallel3d.training.safetensors_stream`` (a safetensors file written tensor by tensor), which
``save_checkpoint`` shares.
"""
