"""An lm-eval model that scores our weights in-process, without the service or its engine: the reference that
`--model local-completions` against the running service must match (issue 22).

A continuation's log-likelihood is read from one full forward of the decoder over context + continuation,
without a KV cache; its `is_greedy` from the argmax at each of its positions. generate_until decodes greedily,
one full forward per token, and stops at an end-of-sequence token, at a stop string (cut before it, as the
service does) or after max_gen_toks. Tokenization is our tokenizer's own (model/bpe_tokenizer.py), as the
service's /tokenize gives it.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM


class ReferenceLM(TemplateLM):
    def __init__(self, model, tokenizer, stop_ids: set[int], max_length: int = 2048):
        super().__init__()
        self.model, self.tok, self.stop_ids, self.max_length = model.eval(), tokenizer, set(stop_ids), max_length

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    @torch.no_grad()
    def _log_probs(self, ids: list[int]) -> torch.Tensor:
        """(T - 1, V) float32 log-probabilities of each next token of `ids`."""
        return torch.log_softmax(self.model(torch.tensor([ids[:-1]])).float()[0], -1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for _, context, continuation in requests:
            ids = (context + continuation)[-(self.max_length + 1):]
            n = len(continuation)
            lp = self._log_probs(ids)[-n:]  # the rows that predict the continuation's tokens
            target = torch.tensor(ids[-n:])
            picked = lp.gather(1, target[:, None])[:, 0]
            out.append((float(picked.sum()), bool((lp.argmax(-1) == target).all())))
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tok.encode(context)
            gen: list[int] = []
            text = ""
            for _ in range(int(kwargs.get("max_gen_toks", 256))):
                t = int(self.model(torch.tensor([ids + gen])).float()[0, -1].argmax())
                if t in self.stop_ids:
                    break
                gen.append(t)
                text = self.tok.decode(gen)
                if any(s in text for s in until):
                    break
            cut = [text.index(s) for s in until if s in text]
            out.append(text[: min(cut)] if cut else text)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            ids = [self.eot_token_id] + self.tok.encode(req.args[0])
            lp = self._log_probs(ids)
            out.append(float(lp.gather(1, torch.tensor(ids[1:])[:, None]).sum()))
        return out
