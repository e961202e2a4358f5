import torch

from roll_gspo.modeling import build_sequences, pad_2d


def test_build_sequences_lays_out_right_padded_rows():
    prompts, responses = [[5, 6, 7], [8]], [[9, 1], []]
    input_ids, attention, prompt_lengths, response_mask = build_sequences(prompts, responses, pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 9, 1], [8, 0, 0, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert prompt_lengths.tolist() == [3, 1]
    assert response_mask.tolist() == [[1.0, 1.0], [0.0, 0.0]] and response_mask.dtype == torch.float32
    assert input_ids.dtype == attention.dtype == torch.long


def test_pad_2d_truncates_to_width_and_handles_empty():
    assert pad_2d([[1, 2, 3], [4]], pad_value=-1, width=2).tolist() == [[1, 2], [4, -1]]
    assert pad_2d([]).shape == (0, 0)
