"""Megatron-compatible data pipeline: indexed .bin/.idx files, GPT samples, blends, samplers, tokenizers."""
from parallel3d.data.blended_dataset import BlendedDataset, build_blending_indices, get_blend_from_list, normalize
from parallel3d.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    build_train_valid_test_datasets,
    get_split_indices,
    parse_and_normalize_split,
)
from parallel3d.data.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_fitting_dtype,
    get_bin_path,
    get_idx_path,
)
from parallel3d.data.samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from parallel3d.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer

__all__ = [
    "BlendedDataset",
    "ByteTokenizer",
    "DType",
    "GPTDataset",
    "GPTDatasetConfig",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetBuilder",
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "best_fitting_dtype",
    "build_blending_indices",
    "build_pretraining_data_loader",
    "build_tokenizer",
    "build_train_valid_test_datasets",
    "get_bin_path",
    "get_blend_from_list",
    "get_idx_path",
    "get_split_indices",
    "normalize",
    "parse_and_normalize_split",
]
