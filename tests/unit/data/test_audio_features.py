"""Speech features against scipy's STFT, the mel filterbank's shape, and WAV round trips."""

import numpy as np
import pytest
import scipy.signal

from flaxformer_lite.data import audio_features as af


def _sine(freq, seconds=0.5, rate=16000, amplitude=0.5):
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("n", [8000, 8001, 7777, 401])
def test_power_spectrogram_equals_scipy_stft(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n)
    window, hop, n_fft = af.frame_sizes(16000, 25, 10)  # 400, 160, 512
    ours = af.power_spectrogram(x, window, hop, n_fft)
    win = scipy.signal.get_window("hann", window)
    _, _, z = scipy.signal.stft(
        x, window=win, nperseg=window, noverlap=window - hop, nfft=n_fft,
        boundary="zeros", padded=True, detrend=False, return_onesided=True,
    )  # fmt: skip
    theirs = np.abs(z.T * win.sum()) ** 2  # scipy scales by 1 / sum(window)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-9, atol=1e-9)


def test_filterbank_rows_are_triangles_at_mel_spaced_centres():
    rate, n_fft, mels = 16000, 512, 40
    bank = af.mel_filterbank(mels, n_fft, rate)
    freqs = np.arange(n_fft // 2 + 1) * rate / n_fft
    centres = af.mel_to_hz(np.linspace(0, af.hz_to_mel(rate / 2), mels + 2))[1:-1]
    assert bank.shape == (mels, n_fft // 2 + 1)
    assert bank.min() >= 0 and bank.max() <= 1
    for m, row in enumerate(bank):
        peak = int(np.argmax(row))
        assert abs(freqs[peak] - centres[m]) <= rate / n_fft  # peak at the nearest bin
        nonzero = np.flatnonzero(row)
        # Rising then falling: non-decreasing up to the peak, non-increasing after it.
        assert np.all(np.diff(row[nonzero[0] : peak + 1]) >= 0)
        assert np.all(np.diff(row[peak : nonzero[-1] + 1]) <= 0)
    # Mel centres are equally spaced on the mel scale.
    np.testing.assert_allclose(np.diff(af.hz_to_mel(centres)), af.hz_to_mel(rate / 2) / (mels + 1))
    # Every bin strictly inside the band is covered by some filter, and neighbours overlap
    # so that the sum of two adjacent triangles is 1 between their centres.
    inside = (freqs > centres[0]) & (freqs < centres[-1])
    assert np.all(bank[:, inside].sum(axis=0) > 0.999)
    assert np.all(bank[:, inside].sum(axis=0) < 1.001)


@pytest.mark.parametrize("freq", [300.0, 1000.0, 2500.0, 6000.0])
def test_a_sine_peaks_in_the_mel_bin_that_holds_its_frequency(freq):
    rate, mels = 16000, 80
    feats = af.log_mel(_sine(freq, rate=rate), rate, num_mels=mels)
    window, hop, n_fft = af.frame_sizes(rate, 25, 10)
    bank = af.mel_filterbank(mels, n_fft, rate)
    bin_of_f = int(round(freq * n_fft / rate))
    holding = set(np.flatnonzero(bank[:, bin_of_f] > 0))  # one or two filters cover it
    peaks = np.argmax(feats[2:-2], axis=1)  # frames away from the zero-padded edges
    assert set(peaks.tolist()) <= holding, (peaks, holding)
    assert feats.shape == (1 + -(-(rate // 2 + 2 * 200 - 400) // 160), mels)
    assert feats.dtype == np.float32


def test_log_floor_and_cmvn():
    feats = af.log_mel(np.zeros(1600, np.float32), 16000, num_mels=8)
    np.testing.assert_allclose(feats, np.log(af.LOG_FLOOR))  # silence is the floor
    x = np.random.default_rng(0).standard_normal((50, 8)) * 3 + 7
    y = af.utterance_cmvn(x)
    np.testing.assert_allclose(y.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(y.std(axis=0), 1, atol=1e-5)
    assert np.all(af.utterance_cmvn(np.ones((5, 3))) == 0)


def test_wav_round_trip_and_clear_errors(tmp_path):
    x = _sine(440, seconds=0.1, rate=8000)
    path = tmp_path / "a.wav"
    af.write_wav(path, x, 8000)
    y, rate = af.read_wav(path)
    assert rate == 8000 and y.dtype == np.float32
    np.testing.assert_allclose(y, x, atol=1 / 32768)
    # int16 samples give the same features as their float scaling.
    ints = np.round(x * 32768).astype(np.int16)
    np.testing.assert_allclose(af.log_mel(ints, 8000), af.log_mel(ints / 32768, 8000), rtol=1e-5)

    import wave

    stereo = tmp_path / "stereo.wav"
    with wave.open(str(stereo), "wb") as f:
        f.setnchannels(2), f.setsampwidth(2), f.setframerate(8000)
        f.writeframes(b"\0" * 400)
    with pytest.raises(af.AudioError, match="only 16-bit PCM mono"):
        af.read_wav(stereo)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not a wav file at all")
    with pytest.raises(af.AudioError, match="not a readable WAV"):
        af.read_wav(bad)
    with pytest.raises(af.AudioError, match="cannot be read"):
        af.read_wav(tmp_path / "missing.wav")
