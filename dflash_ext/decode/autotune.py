"""The target alone, timed: one one-token pass after a prompt (:func:`time_target_alone`) and
the fastest of the dtypes and linear-layer paths this machine runs it in
(:func:`fastest_target_alone`). The demo (``python -m dflash_ext generate``, its ``--dtype
auto`` and ``--baseline``) and the tests use it."""
import copy

import torch


@torch.no_grad()
def time_target_alone(model, ids, stream: bool, reps: int = 7) -> float:
    """Seconds of one one-token pass of the target alone after the prompt `ids` (median of
    `reps`, after one untimed), its linear layers through skinny_linear (`stream`) or F.linear."""
    from .decoding import _median_seconds
    from .target import CacheRollback, TargetRunner, streamed_linears

    with streamed_linears(model, enabled=stream):
        runner = TargetRunner(model)
        x = torch.as_tensor([ids], device=runner.device)
        _, _, cache = runner(x, None, hidden_states=False, last_logits_only=True)
        rollback = CacheRollback(cache, 1)  # undoes each timed pass on every cache kind (windows, hybrids)

        def step():
            runner(x[:, -1:], cache, hidden_states=False, last_logits_only=True, rollback=rollback)
            rollback(1)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)

        step()
        return _median_seconds(step, reps)


def fastest_target_alone(model, ids, device) -> tuple:
    """({(dtype, stream): seconds per token}, {dtype: model}): the target alone timed in fp32
    and bf16, on the CPU with its linear layers through F.linear and through skinny_linear
    (which wins depends on the CPU: on an AMX Xeon one-token decoding ran faster in fp32).
    `model` is the fp32 one; the bf16 copy is made here."""
    models = {torch.float32: model, torch.bfloat16: copy.deepcopy(model).to(torch.bfloat16)}
    streams = (False, True) if torch.device(device).type == "cpu" else (False,)
    timings = {(dtype, stream): time_target_alone(m, ids, stream) for dtype, m in models.items() for stream in streams}
    return timings, models
