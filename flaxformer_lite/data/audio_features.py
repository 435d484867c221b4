"""Audio in, speech features out: WAV reading, log-mel filterbanks and utterance CMVN.

Letters: N samples, K frames, M mel channels, R = n_fft // 2 + 1 frequency bins.

The features are those of fairseq's speech-to-text recipes and Whisper: 25 ms Hann windows
every 10 ms, the power spectrum, M triangular filters on the HTK mel scale
``mel(f) = 2595 log10(1 + f / 700)``, the natural log with a floor, then each utterance's
channels normalised to mean 0 and variance 1 (utterance-level CMVN, fairseq's
``UtteranceCMVN``). Only numpy is used, so features cost nothing on the accelerator.
"""

from __future__ import annotations

import os
import wave

import numpy as np

HOP_MS = 10.0  # frame hop of the project's speech features (window 25 ms)

LOG_FLOOR = 1e-10  # power below this is clamped before the log (Whisper's floor)


class AudioError(ValueError):
    """A file that is not 16-bit PCM mono WAV, or is unreadable; the message is one line."""


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Reads a 16-bit PCM mono WAV file.

    Returns:
        ``(float32[N] in [-1, 1), sample_rate)``: samples divided by 32768.

    Raises:
        AudioError: the file is missing, not a WAV file, or not 16-bit PCM mono.
    """
    try:
        with wave.open(os.fspath(path), "rb") as f:
            channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
            if f.getcomptype() != "NONE" or width != 2 or channels != 1:
                raise AudioError(
                    f"{path}: {channels} channel(s) of {8 * width}-bit {f.getcomptype()} audio;"
                    " only 16-bit PCM mono WAV is read (convert it, e.g. "
                    "`sox in.wav -b 16 -c 1 out.wav`)"
                )
            raw = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as e:
        raise AudioError(f"{path}: not a readable WAV file ({e})") from e
    except OSError as e:
        raise AudioError(f"{path}: cannot be read ({e.strerror or e})") from e
    return (np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0), rate


def write_wav(path: str | os.PathLike, samples: np.ndarray, sample_rate: int) -> None:
    """Writes ``float[N]`` in [-1, 1] (clipped) or ``int16[N]`` as 16-bit PCM mono WAV."""
    samples = np.asarray(samples)
    if samples.dtype != np.int16:
        samples = np.round(np.clip(samples, -1.0, 32767 / 32768) * 32768).astype(np.int16)
    with wave.open(os.fspath(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(samples.astype("<i2").tobytes())


def frame_sizes(sample_rate: int, window_ms: float, hop_ms: float) -> tuple[int, int, int]:
    """(window, hop, n_fft) in samples: n_fft is the window rounded up to a power of two."""
    window = int(round(sample_rate * window_ms / 1000))
    hop = int(round(sample_rate * hop_ms / 1000))
    if window < 2 or hop < 1:
        raise ValueError(f"window_ms={window_ms}, hop_ms={hop_ms} give {window}/{hop} samples")
    return window, hop, 1 << (window - 1).bit_length()


def power_spectrogram(samples: np.ndarray, window: int, hop: int, n_fft: int) -> np.ndarray:
    """``float64[K, R]``: |rfft(hann * frame)|^2 of frames ``k * hop .. k * hop + window``.

    The signal is zero-padded by ``window // 2`` on both sides (frames are centred on
    ``k * hop``) and at the end to fill the last frame: K = 1 + ceil(N / hop) frames less
    those starting past the end, i.e. ``1 + (N + 2 * (window // 2) - window + hop - 1) // hop``
    (at least 1). The Hann window is periodic (``scipy.signal.get_window("hann", window)``).
    """
    x = np.asarray(samples, dtype=np.float64)
    half = window // 2
    frames = max(1, 1 + -(-(x.size + 2 * half - window) // hop))
    padded = np.zeros((frames - 1) * hop + window)
    padded[half : half + x.size] = x[: padded.size - half]
    index = np.arange(frames)[:, None] * hop + np.arange(window)  # [K, window]
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(window) / window)  # periodic
    spectrum = np.fft.rfft(padded[index] * hann, n=n_fft, axis=-1)  # [K, R]
    return spectrum.real**2 + spectrum.imag**2


def hz_to_mel(hz):
    """The HTK mel scale: 2595 log10(1 + f / 700)."""
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def mel_to_hz(mel):
    """The inverse of :func:`hz_to_mel`."""
    return 700.0 * (10.0 ** (np.asarray(mel, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(
    num_mels: int, n_fft: int, sample_rate: int, low_hz: float = 0.0, high_hz: float | None = None
) -> np.ndarray:
    """``float64[M, R]``: triangular filters, peak 1, centres equally spaced in HTK mel.

    Filter m rises from the frequency of mel point m to 1 at point m + 1 and falls to 0 at
    point m + 2, of M + 2 points equally spaced in mel from ``low_hz`` to ``high_hz``
    (default Nyquist). Triangles are evaluated at the exact bin frequencies (as librosa does)
    rather than snapped to bins (as HTK and Kaldi do), so narrow low filters are never empty.
    Not area-normalised (HTK, not Slaney): the log then only shifts by a per-channel constant,
    which CMVN removes.
    """
    high_hz = sample_rate / 2 if high_hz is None else high_hz
    if not 0 <= low_hz < high_hz <= sample_rate / 2:
        raise ValueError(f"mel band {low_hz}..{high_hz} Hz must lie in 0..{sample_rate / 2} Hz")
    points = mel_to_hz(np.linspace(hz_to_mel(low_hz), hz_to_mel(high_hz), num_mels + 2))
    freqs = np.arange(n_fft // 2 + 1) * sample_rate / n_fft  # [R]
    left, centre, right = points[:-2, None], points[1:-1, None], points[2:, None]  # [M, 1]
    rising = (freqs - left) / (centre - left)
    falling = (right - freqs) / (right - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


def log_mel(
    samples: np.ndarray,
    sample_rate: int,
    num_mels: int = 80,
    window_ms: float = 25.0,
    hop_ms: float = 10.0,
) -> np.ndarray:
    """``float32[K, M]``: log(max(mel filterbank . power spectrum, LOG_FLOOR)) per frame.

    ``samples`` is ``float[N]`` in [-1, 1] (or ``int16[N]``, scaled by 1/32768); frames as in
    :func:`power_spectrogram`.
    """
    samples = np.asarray(samples)
    if samples.dtype == np.int16:
        samples = samples.astype(np.float32) / 32768.0
    window, hop, n_fft = frame_sizes(sample_rate, window_ms, hop_ms)
    power = power_spectrogram(samples, window, hop, n_fft)  # [K, R]
    mel = power @ mel_filterbank(num_mels, n_fft, sample_rate).T  # [K, M]
    return np.log(np.maximum(mel, LOG_FLOOR)).astype(np.float32)


def utterance_cmvn(features: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """``float32[K, M]``: every channel of one utterance shifted to mean 0 and scaled to
    variance 1 over its K frames (fairseq's ``UtteranceCMVN``; a constant channel becomes 0)."""
    x = np.asarray(features, dtype=np.float64)
    mean = x.mean(axis=0)
    std = np.sqrt(np.maximum(x.var(axis=0), eps))
    return ((x - mean) / std).astype(np.float32)


def speech_features(
    samples: np.ndarray, sample_rate: int, num_mels: int = 80, window_ms=25.0, hop_ms=10.0
) -> np.ndarray:
    """``float32[K, M]``: :func:`utterance_cmvn` of :func:`log_mel`, what the speech task
    stores and what decoding computes from a WAV file."""
    return utterance_cmvn(log_mel(samples, sample_rate, num_mels, window_ms, hop_ms))
