"""Datasets (verl's parquet row format), chat templates, the synthetic task and the char tokenizer."""

from verl_lite.data.char_tokenizer import build_char_tokenizer, save_char_tokenizer
from verl_lite.data.dataset import DataError, RLDataset, encode_prompt, epoch_order, iterate_batches, num_batches
from verl_lite.data.synthetic import DATA_SOURCE as SYNTHETIC_DATA_SOURCE
from verl_lite.data.synthetic import make_synthetic_task, score_addition

__all__ = ["DataError", "RLDataset", "SYNTHETIC_DATA_SOURCE", "build_char_tokenizer", "encode_prompt", "epoch_order",
           "iterate_batches", "make_synthetic_task", "num_batches", "save_char_tokenizer", "score_addition"]
