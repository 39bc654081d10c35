"""A proposer that knows the answer, for the decoding tests and bench/gpu_e2e.py: it drives
the loop (``spec_generate(target, proposer, ...)``) at a chosen acceptance without a drafter."""
import torch


class OracleProposer:
    """Proposes the known continuation (τ near B); every `wrong_every`-th proposed token is
    replaced by a wrong one so that partial acceptance is exercised too."""

    def __init__(self, continuation, n_prompt, vocab_size, wrong_every=0):
        self.cont, self.n_prompt, self.V, self.wrong_every = list(continuation), n_prompt, vocab_size, wrong_every
        self.calls = 0

    def accept(self, hidden_states, rows, positions):
        pass

    def propose(self, last_token, position, n):
        start = position + 1 - self.n_prompt
        toks = (self.cont[start:start + n] + [0] * n)[:n]
        self.calls += 1
        if self.wrong_every and self.calls % self.wrong_every == 0 and n > 1:
            toks[n // 2] = (toks[n // 2] + 1) % self.V
        return torch.tensor(toks, dtype=torch.long)
