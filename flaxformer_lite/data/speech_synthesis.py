"""Text to speech with espeak-ng: the `espeak-ng` command, else the library bundled by the
`espeakng-loader` wheel (`pip install '.[speech]'`), through ctypes.

Letters: N samples.

Both backends give the same formant synthesiser (22050 Hz, 16-bit mono); a voice is a
language and an espeak variant (``"en"`` + ``"m3"`` is ``-v en+m3``), with the speaking rate
in words per minute and the pitch in 0..99.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from flaxformer_lite.data.audio_features import read_wav

MISSING = (
    "speech synthesis needs espeak-ng: `pip install '.[speech]'` (the espeakng-loader wheel) "
    "or `apt-get install espeak-ng`"
)


class SynthesisUnavailable(RuntimeError):
    """Neither the espeak-ng command nor the espeakng-loader library is present."""


def _command() -> str | None:
    return shutil.which("espeak-ng")


@functools.cache
def _library():
    """(the espeak-ng library initialised for synchronous output, its sample rate) or None."""
    try:
        import espeakng_loader
    except ImportError:
        return None
    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    audio_output_synchronous = 2
    rate = lib.espeak_Initialize(
        audio_output_synchronous, 0, espeakng_loader.get_data_path().encode(), 0
    )
    if rate <= 0:
        return None
    return lib, rate


# int callback(short *wav, int numsamples, espeak_EVENT *events): 0 = continue.
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)
_LIBRARY_LOCK = threading.Lock()  # the library keeps one global voice and callback


def backends() -> tuple[str, ...]:
    """The backends present here, of ``("command", "library")``, the preferred one first."""
    found = (("command", _command()), ("library", _library()))
    return tuple(name for name, present in found if present is not None)


def available() -> bool:
    """Whether :func:`synthesize` can run (the command on PATH, or the wheel's library)."""
    return bool(backends())


def backend() -> str:
    """``"command"``, ``"library"``, or ``"none"``: what :func:`synthesize` would use."""
    return (*backends(), "none")[0]


def synthesize(
    text: str,
    language: str,
    voice_variant: str = "",
    rate_wpm: int = 175,
    pitch: int = 50,
    *,
    use: str | None = None,
) -> tuple[np.ndarray, int]:
    """Speaks ``text`` with the espeak-ng voice ``language`` [+ ``voice_variant``].

    Args:
        text: what to say (UTF-8).
        language: an espeak-ng voice, e.g. "en", "de", "fr".
        voice_variant: an espeak variant such as "m3", "f2" ("" = the voice's default).
        rate_wpm: speaking rate, words per minute (80..450).
        pitch: base pitch, 0..99.
        use: "command" or "library" to force a backend; None picks the command when present.

    Returns:
        ``(int16[N], sample_rate)``.

    Raises:
        SynthesisUnavailable: no backend (the message names both installs).
    """
    voice = f"{language}+{voice_variant}" if voice_variant else language
    use = use or backend()
    if use not in backends():
        raise SynthesisUnavailable(MISSING)
    speak = _with_command if use == "command" else _with_library
    return speak(text, voice, rate_wpm, pitch)


def _with_command(text: str, voice: str, rate_wpm: int, pitch: int) -> tuple[np.ndarray, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.wav")
        subprocess.run(
            [
                _command(),
                "-v",
                voice,
                "-s",
                str(rate_wpm),
                "-p",
                str(pitch),
                "-w",
                path,
                "--",
                text,
            ],
            check=True,
            capture_output=True,
        )
        samples, rate = read_wav(path)
    return np.round(samples * 32768).astype(np.int16), rate


def _with_library(text: str, voice: str, rate_wpm: int, pitch: int) -> tuple[np.ndarray, int]:
    lib, rate = _library()
    chunks: list[np.ndarray] = []

    def collect(wav, count, events):
        del events
        if wav and count > 0:
            chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0

    callback = _CALLBACK(collect)  # kept alive until synthesis returns
    espeak_rate, espeak_pitch, pos_character, chars_utf8 = 1, 3, 1, 1
    data = text.encode("utf-8") + b"\0"
    with _LIBRARY_LOCK:
        lib.espeak_SetSynthCallback(callback)
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        lib.espeak_SetParameter(espeak_rate, int(rate_wpm), 0)
        lib.espeak_SetParameter(espeak_pitch, int(pitch), 0)
        status = lib.espeak_Synth(data, len(data), 0, pos_character, 0, chars_utf8, None, None)
        lib.espeak_Synchronize()
    if status != 0:
        raise RuntimeError(f"espeak-ng failed to speak {text!r} (status {status})")
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    return samples.astype(np.int16), rate
