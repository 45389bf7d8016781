import torch
def greedy_verify(best, drafts, lengths):
    k = drafts.shape[1]
    j = torch.arange(k, device=drafts.device)
    match = (best[:, :k] == drafts) & (j < lengths.unsqueeze(1))
    acc = match.long().cumprod(1).sum(1)
    return None, acc + 1
