"""One process trains with the same mixed precision as many: the trainer's master
weights, gradients and AdamW state are fp32, while forwards, the engine (on the
gathered parameters) and the reference model run in model.dtype."""

import torch

from rollplex.config import load_config
from rollplex.rl.loop import RLTrainer
from test_rl_loop import FAST


def test_one_process_keeps_fp32_master_weights_and_computes_in_bf16(tmp_path):
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--model.dtype", "bfloat16",
                                            "--algorithm.kl_coef", "0.01", "--trainer.total_steps", "1",
                                            "--trainer.eval_every", "0"]))
    logits_dtypes, grad_dtypes = set(), set()
    trainer.model.lm_head.register_forward_hook(lambda module, args, out: logits_dtypes.add(out.dtype))
    trainer.actor.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grad_dtypes.update(
        p.grad.dtype for group in optimizer.param_groups for p in group["params"] if p.grad is not None))
    trainer.fit()

    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert grad_dtypes == {torch.float32}
    moments = [v for state in trainer.actor.optimizer.state.values() for k, v in state.items() if k != "step"]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    assert logits_dtypes == {torch.bfloat16}  # rollout, logprob passes and the update
    assert trainer.engine.cache.dtype == torch.bfloat16  # the engine read the gathered parameters' dtype
    with trainer.weights.for_rollout() as engine_model:
        assert {p.dtype for p in engine_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}
