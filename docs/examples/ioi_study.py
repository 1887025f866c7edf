"""A patching study in a dozen lines: IOI-style prompts on a 2-layer GPT-2 built from its config.

The weights are random, so the numbers are not a circuit; load trained weights
(``GPT2LMHeadModel.from_pretrained("gpt2")`` and its tokenizer) and the same lines find one.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hookscope as hs

words = "<bos> When Mary John and went to the store , gave a drink".split()
vocab = {word: index for index, word in enumerate(words)}


def ids(text: str) -> torch.Tensor:
    return torch.tensor([[vocab[word] for word in text.split()]])


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=len(words))).eval()
clean = ids("When Mary and John went to the store , John gave a drink to")
corrupted = ids("When Mary and John went to the store , Mary gave a drink to")  # the subject repeated
metric = hs.methods.logit_diff(vocab["Mary"], vocab["John"])  # the indirect object over the subject

sweep = hs.methods.patch_sweep(model, clean, corrupted, metric=metric)  # every block's resid_pre × position
atp = hs.methods.attribution_patch(model, clean, corrupted, metric=metric, verify=5)
print(sweep)
print(f"AtP against the sweep: r = {atp.correlation(sweep):.3f}; sign flips: {[str(flag) for flag in atp.flags]}")

heads = hs.methods.patch_sweep(model, clean, corrupted, metric=metric, heads=True, positions="all")
(site, head, _), effect = heads.top(1)[0]
print(f"strongest head: {site} head {head}, effect {effect:+.3f}")

lens = hs.methods.logit_lens(model, clean, metric=metric, decode=words)
print(lens)

with torch.no_grad():  # confirm by ablation: zero that head in the clean run
    before = metric(model(clean)).item()
    ablated, _ = hs.run_with_edits(model, clean, edits={f"std:{site}": hs.edits.zero(heads=head)})
print(f"logit difference {before:+.4f} -> {metric(ablated).item():+.4f} with {site} head {head} zeroed")
sweep.plot().savefig("sweep.png")
