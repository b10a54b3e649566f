"""The offline API: `LLM(model).generate(prompts, sampling_params)` and `.chat(messages)`, vLLM's names."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from tqdm.auto import tqdm

from tokenmill.config import engine_config_from_kwargs
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import Processor, PromptType
from tokenmill.model.loader import LoadedModel
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

class LLM:
    def __init__(self, model: str | LoadedModel | None = None, **engine_args):
        """`model`: an HF directory, a .gguf file, None for the embedded default, or an already
        loaded model (to build several engines over one set of weights)."""
        loaded = model if isinstance(model, LoadedModel) else None
        config, prefix_caching = engine_config_from_kwargs(loaded.source if loaded else model, **engine_args)
        if config.parallel.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size={config.parallel.data_parallel_size}: LLM runs one engine core in this "
                "process; data-parallel engine cores run behind AsyncLLM (tokenmill serve, tokenmill bench)"
            )
        self.engine = EngineCore(config, model=loaded, enable_prefix_caching=prefix_caching)
        self.processor = Processor(self.engine.model, config.scheduler.max_model_len)
        self._step = self.engine.step_with_batch_queue if config.async_scheduling else self.engine.step
        self.tokenizer = self.engine.model.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Free the engine's workers on Ray now (an LLM that is garbage-collected does it then)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling_params")
        # Validate everything before queueing anything: a bad prompt loses nothing.
        inputs = []
        for prompt, params in zip(prompts, sampling_params):
            text, ids = self.processor.tokenize(prompt)
            self.processor.validate(ids, params)
            inputs.append((text, ids, params))
        return self._run(inputs, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.processor.render_chat(conversation, add_generation_prompt, chat_template)
            prompts.append({"prompt": text, "prompt_token_ids": self.processor.tokenize_chat(text)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, inputs, use_tqdm: bool) -> list[RequestOutput]:
        outputs = OutputProcessor(self.tokenizer)
        order: list[str] = []
        children: dict[str, list[str]] = {}
        parent_of: dict[str, str] = {}
        for text, ids, params in inputs:
            request_id = str(next(self._ids))
            order.append(request_id)
            children[request_id] = []
            for index in range(params.n):
                # n samples are n requests sharing the prompt's cached blocks; seeded ones get seed + index
                child_params = params
                if params.n > 1:
                    seed = None if params.seed is None else params.seed + index
                    child_params = dataclasses.replace(params, n=1, seed=seed)
                child_id = request_id if params.n == 1 else f"{request_id}-{index}"
                outputs.add_request(child_id, text, ids, child_params, index=index)
                self.engine.add_request(child_id, ids, child_params)
                children[request_id].append(child_id)
                parent_of[child_id] = request_id
        finished: dict[str, RequestOutput] = {}
        # no bar at all when none is shown: a first tqdm, even disabled, makes a multiprocessing lock (~0.1 s)
        bar = tqdm(total=len(order), desc="Processed prompts") if use_tqdm and len(order) >= 8 else None
        try:
            while outputs.has_unfinished():
                updates = self._step()
                results, to_abort = outputs.process(updates)
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for state, out in results:
                    if out.finished:
                        finished[state.request_id] = out
                        if all(c in finished for c in children[parent_of[state.request_id]]):
                            if bar is not None:
                                bar.update(1)
        except BaseException:  # interrupted: leave the engine clean for the next call
            unfinished = list(outputs.states)
            for request_id in unfinished:
                outputs.abort(request_id)
            self.engine.abort_requests(unfinished)
            raise
        finally:
            if bar is not None:
                bar.close()
        results = []
        for request_id in order:
            parts = [finished[c] for c in children[request_id]]
            merged = parts[0]
            if len(parts) > 1:
                merged = dataclasses.replace(
                    merged, request_id=request_id, outputs=[p.outputs[0] for p in parts]
                )
            results.append(merged)
        return results
