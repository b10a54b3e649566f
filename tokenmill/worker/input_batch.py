"""The persistent batch: every request the runner holds, one row each, in host (numpy) arrays.

Rows live across steps so a step only writes what changed (new requests, new blocks, sampled
tokens) instead of rebuilding the batch from Python objects.
"""

from __future__ import annotations

import numpy as np

from tokenmill.core.step_io import NewRequestData
from tokenmill.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int):
        self.max_num_seqs = max_num_seqs
        self.token_ids = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, np.int32)
        self.num_computed = np.zeros(max_num_seqs, np.int32)
        self.num_pending = np.zeros(max_num_seqs, np.int32)  # tokens being sampled by launched steps
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(max_num_seqs, np.int32)
        self.seeds = np.zeros(max_num_seqs, np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_seqs
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, req: NewRequestData) -> None:
        if req.req_id in self.row_of:
            raise ValueError(f"request {req.req_id!r} is already in the batch")
        if not self._free_rows:
            raise RuntimeError(f"the batch is full ({self.max_num_seqs} requests)")
        n = len(req.token_ids)
        if n > self.token_ids.shape[1]:
            raise ValueError(f"request {req.req_id!r} has {n} tokens, more than max_model_len")
        row = self._free_rows.pop()
        self.row_of[req.req_id] = row
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed[row] = req.num_computed_tokens
        self.num_pending[row] = 0
        self.num_blocks[row] = 0
        self.append_blocks(req.req_id, req.block_ids)
        self.seeds[row] = req.seed
        self.params[row] = req.sampling_params

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self._free_rows.append(row)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        row = self.row_of[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        if n < self.token_ids.shape[1]:
            self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1

    def prompt_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, : self.num_prompt_tokens[row]]

    def output_ids(self, row: int) -> np.ndarray:
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]
