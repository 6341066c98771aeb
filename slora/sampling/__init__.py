"""From logits to output text: sampling parameters, sampler, logit controls, grammars, stopping."""
