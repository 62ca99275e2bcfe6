"""GRPO on a tiny masked-diffusion model in PyTorch: rollouts with the denoising step, scoring
with ``per_token_logps``, and TRL's policy loss from a tied ``LinearHead`` (the [B, L, K]
logits never exist in the update).

Each step draws G completions for each prompt by iterative unmasking (``sample_tokens`` on
the head, ``commit_tokens`` keeps the surest positions), rewards them (here: the share of
completion tokens in the lower quarter of the vocabulary), normalises the rewards within
each group into advantages, scores the completions once with the policy that sampled them
(``old_logps``) and with a frozen reference model (``ref_logps``), then takes
``num_iterations`` optimizer steps on ``policy_loss``. The scoring canvas is the prompt with
the whole completion masked, the one-step estimate of the completion's log-probability
that diffusion GRPO variants use; the completion mask is the batch's loss weights.

    python examples/grpo_step_torch.py
"""

from __future__ import annotations

import argparse
import copy

import torch

import dlm_kernels.torch as dk

V, D = 64, 32  # vocabulary (the last id is the mask token), width
MASK = V - 1
PROMPT, COMPLETION = 4, 12
TEMPERATURE = 0.9  # of the rollouts, and so of every log-prob of the loss


class TinyDenoiser(torch.nn.Module):
    """[B, L] token ids -> [B, L, D] hidden states; its embedding is also the unembedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)  # weight [V, D]: the head's "KD" layout
        torch.nn.init.normal_(self.embed.weight, std=0.3)
        self.position = torch.nn.Parameter(torch.randn(PROMPT + COMPLETION, D) * 0.3)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(),
                                       torch.nn.Linear(2 * D, D))
        # a trained predictor never proposes the mask token: its logit is -inf
        self.register_buffer("bias", torch.zeros(V).index_fill_(0, torch.tensor(MASK),
                                                               float("-inf")))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[None]
        return h + self.mlp(h + h.mean(dim=1, keepdim=True))  # every position sees the canvas

    def head(self, tokens: torch.Tensor) -> dk.LinearHead:
        """The logits of ``tokens`` as a tied LinearHead (never [B, L, V])."""
        return dk.LinearHead(self(tokens), self.embed.weight, self.bias, weight_layout="KD")


@torch.no_grad()
def rollout(model: TinyDenoiser, prompts: torch.Tensor, seeds: torch.Tensor,
            steps: int = 4) -> torch.Tensor:
    """Complete every prompt by unmasking COMPLETION // steps positions per step."""
    canvas = torch.cat([prompts, torch.full((len(prompts), COMPLETION), MASK)], dim=1)
    for step in range(steps):
        sample = dk.sample_tokens(model.head(canvas), temperature=TEMPERATURE, seed=seeds,
                                  step=step, suppress_ids=MASK)
        canvas, _ = dk.commit_tokens(canvas, sample, canvas == MASK, k=COMPLETION // steps)
    return canvas


def scoring_batch(canvas: torch.Tensor) -> dk.DiffusionTokenBatch:
    """The completion masked in the model's input, its tokens the targets; the completion
    mask (1 on the completion, 0 on the prompt) the loss weights."""
    masked = canvas.clone()
    masked[:, PROMPT:] = MASK
    weights = torch.zeros(canvas.shape)
    weights[:, PROMPT:] = 1.0
    return dk.DiffusionTokenBatch.create(model_inputs=masked, target_ids=canvas,
                                         loss_weights=weights)


def advantages_of(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """TRL's group-normalised advantages: (r - group mean) / (group std + 1e-4)."""
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def main(steps: int = 4, prompts: int = 2, group: int = 4, num_iterations: int = 2,
         beta: float = 0.04, seed: int = 0) -> list[dict[str, float]]:
    """Train for ``steps`` rollouts; return each update's loss and metrics."""
    torch.manual_seed(seed)
    model = TinyDenoiser()
    reference = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prompt_ids = torch.randint(0, MASK, (prompts, PROMPT)).repeat_interleave(group, dim=0)
    log = []
    for step in range(steps):
        seeds = torch.arange(len(prompt_ids)) + 1000 * step  # one per sequence
        canvas = rollout(model, prompt_ids, seeds)
        rewards = (canvas[:, PROMPT:] < V // 4).float().mean(dim=1)
        batch = scoring_batch(canvas)
        with torch.no_grad():
            old = dk.per_token_logps(model.head(batch.model_inputs), batch,
                                     temperature=TEMPERATURE)
            ref = dk.per_token_logps(reference.head(batch.model_inputs), batch,
                                     temperature=TEMPERATURE)
        advantages = advantages_of(rewards, group)
        for iteration in range(num_iterations):
            result = dk.policy_loss(model.head(batch.model_inputs), batch, old_logps=old,
                                    advantages=advantages, loss_type="dapo", beta=beta,
                                    ref_logps=ref, temperature=TEMPERATURE, epsilon_high=0.28)
            optimizer.zero_grad()
            result.loss.backward()
            optimizer.step()
            log.append(dict(step=step, iteration=iteration, reward=rewards.mean().item(),
                            loss=result.loss.item(), kl=result.kl.item(),
                            clip_ratio=result.clip_ratio_region.item(),
                            entropy=result.entropy.item()))
            print("step {step} iteration {iteration}: reward {reward:.3f} loss {loss:+.4f} "
                  "kl {kl:.5f} clip {clip_ratio:.3f} entropy {entropy:.3f}".format(**log[-1]))
    return log


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    main(parser.parse_args().steps)
