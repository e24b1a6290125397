"""Found by an adversarial review of this session's later changes: a byte-fallback decoder chain that fuses its
pieces before reading bytes, and two `rdepth analyze` runs that start at once on a new output directory."""

from __future__ import annotations

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

import recurrent_depth as rd
from recurrent_depth.analysis import report
from recurrent_depth.analysis.report import AnalysisConfig, analyze_to_dir
from recurrent_depth.files import lock_directory
from recurrent_depth.serving.text import TextCodec
from tests.test_bytefallback_s36 import PIECES, byte, pieces, reference_pieces

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_decoder_that_fuses_before_its_byte_fallback_decodes_runs_the_exact_way(tmp_path):
    """`Fuse` before `ByteFallback` leaves no `<0xNN>` piece for it (the text shows `<0x20>` as written), yet
    `_runs_decode_alone` took the chain for one whose runs decode alone: `ByteRun` then sent U+FFFD-based chunks
    of other lengths and lost text (the second `<0x20>` of a prompt that opens with two)."""
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(PIECES)}, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.ByteFallback(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec(tmp_path, len(PIECES))
    assert not codec.byte_runs
    ids = [byte(0x20), byte(0x20), byte(0x80), byte(0xB8), PIECES.index("a"), byte(0xE4)]
    for continuation in (False, True):
        assert pieces(codec, ids, continuation) == reference_pieces(codec, ids, continuation, True)


def test_a_run_refused_by_anothers_lock_leaves_the_directory_it_did_not_make(tmp_path, monkeypatch):
    """Two runs started together on a missing OUT both saw it missing; the one the other's lock refused removed
    OUT as its own (`created`), the running one's states and lock file with it (so a third run could start there).
    The other run is simulated: it makes OUT and takes the lock between this run's check and its lock."""
    out = tmp_path / "out"
    held = []

    def the_other_run_locks_first(directory, what):
        held.append(lock_directory(directory, what))  # (the other run's lock, kept open)
        (out / "states").mkdir()
        (out / "states" / "its_states.npy").write_bytes(b"x")
        return lock_directory(directory, what)  # (refused)

    monkeypatch.setattr(report, "lock_directory", the_other_run_locks_first)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()
    with pytest.raises(ValueError, match="is in use by"):
        analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(num_steps=4, limit_steps=4))
    assert (out / "states" / "its_states.npy").read_bytes() == b"x"
    with pytest.raises(ValueError, match="is in use by"):  # (its lock file is still there: a third run waits too)
        lock_directory(out)
    held[0].close()
