"""Proposers without a drafter, for the decoding tests and bench/gpu_e2e.py: they drive the
loop (``spec_generate(target, proposer, ...)``). :class:`OracleProposer` knows the answer (a
chosen acceptance); :class:`DistributionProposer` samples its drafts from a fixed distribution
q and hands q over (a deliberately bad drafter, for the rejection rule's tests)."""
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


class DistributionProposer:
    """Drafts every slot from the fixed distribution `probs` [V] over the target's vocabulary
    (uniform, a point mass...), with `generator`, and returns (tokens, q) as a sampling
    drafter does (:class:`~dflash_ext.sampling.Draft`)."""

    def __init__(self, probs, generator=None):
        self.probs, self.generator = torch.as_tensor(probs, dtype=torch.float32), generator

    def accept(self, hidden_states, rows, positions):
        pass

    def propose(self, last_token, position, n):
        q = self.probs.expand(n, -1)
        return torch.multinomial(q, 1, replacement=True, generator=self.generator)[:, 0], q
