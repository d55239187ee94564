"""A transcription's segments in the ``response_format`` asked for: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

import msgspec

from mlxd.shared.protocol import Segment

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")

# Whisper's languages by ISO 639-1 code (verbose_json names the language, as OpenAI's route does).
LANGUAGES = dict(pair.split(":") for pair in (
    "en:english zh:chinese de:german es:spanish ru:russian ko:korean fr:french ja:japanese pt:portuguese "
    "tr:turkish pl:polish ca:catalan nl:dutch ar:arabic sv:swedish it:italian id:indonesian hi:hindi "
    "fi:finnish vi:vietnamese he:hebrew uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish "
    "hu:hungarian ta:tamil no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian la:latin "
    "mi:maori ml:malayalam cy:welsh sk:slovak te:telugu fa:persian lv:latvian bn:bengali sr:serbian "
    "az:azerbaijani sl:slovenian kn:kannada et:estonian mk:macedonian br:breton eu:basque is:icelandic "
    "hy:armenian ne:nepali mn:mongolian bs:bosnian kk:kazakh sq:albanian sw:swahili gl:galician "
    "mr:marathi pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba so:somali af:afrikaans oc:occitan "
    "ka:georgian be:belarusian tg:tajik sd:sindhi gu:gujarati am:amharic yi:yiddish lo:lao uz:uzbek "
    "fo:faroese ht:haitian_creole ps:pashto tk:turkmen nn:nynorsk mt:maltese sa:sanskrit lb:luxembourgish "
    "my:myanmar bo:tibetan tl:tagalog mg:malagasy as:assamese tt:tatar haw:hawaiian ln:lingala ha:hausa "
    "ba:bashkir jw:javanese su:sundanese yue:cantonese").split())


class Usage(msgspec.Struct):
    seconds: float
    type: str = "duration"


class Transcript(msgspec.Struct, omit_defaults=True):
    text: str
    usage: Usage | None = None


class VerboseTranscript(msgspec.Struct):
    task: str
    language: str
    duration: float
    text: str
    segments: list[dict]  # each a Segment's fields by name (the wire sends them as an array)
    usage: Usage


def full_text(segments: list[Segment]) -> str:
    return "".join(s.text for s in segments).strip()


def _clock(seconds: float, decimal: str) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def render(fmt: str, segments: list[Segment], task: str, language: str, duration: float) -> tuple[bytes, str]:
    """(body, media type) of the transcription in ``fmt`` (one of FORMATS)."""
    text = full_text(segments)
    if fmt == "text":
        return (text + "\n").encode(), "text/plain; charset=utf-8"
    if fmt == "srt":
        cues = [f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
                for i, s in enumerate(segments, 1)]
        return "\n".join(cues).encode(), "text/plain; charset=utf-8"
    if fmt == "vtt":
        cues = [f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n" for s in segments]
        return "\n".join(["WEBVTT\n", *cues]).encode(), "text/vtt; charset=utf-8"
    usage = Usage(seconds=round(duration, 3))
    if fmt == "verbose_json":
        body = VerboseTranscript(
            task=task, language=LANGUAGES.get(language, language), duration=round(duration, 3), text=text,
            segments=[msgspec.structs.asdict(s) for s in segments],
            usage=usage)
    else:
        body = Transcript(text=text, usage=usage)
    return msgspec.json.encode(body), "application/json"
