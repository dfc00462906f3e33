"""A store's answer parsed within bounds on what parsing it builds, checked on its bytes first.

The body of an answer is already bounded (client.read_listing: 16 MiB), but what a parser
builds from it is not: json.loads makes a dict of every ``{}`` (16 MiB of them cost 1 GB and
17 s), ElementTree an element of every ``<a/>`` and an entry of every attribute, botocore a
dict of every ``<Contents/>``.  So the values (JSON) or tags and attributes (XML) an answer
holds are counted on its bytes, cheaply and never below what the parser would build, and an
answer holding more than a page of entries can hold is refused (ValueError: the store would
answer the same again) before anything is built.

The allowance is ENTRY_NODES a listed entry (an object, a prefix) of the page asked for:
far above what a real one holds (GCS lists four fields an item, ckptfmt asks for no others; an
S3 <Contents> holds about 15 tags, an Azure <Blob> up to about 90 with every property Azure
has), far below what costs memory (256,000 nodes of a 1000-entry page: about 50 MB at worst).
"""

from __future__ import annotations

import json
import pyexpat
import re
import xml.etree.ElementTree as ET
from typing import Any

#: JSON values and strings, or XML tags and attributes, one listed entry may hold
ENTRY_NODES = 256
#: the nodes an answer describing one object may hold: GCS's object resource carries the
#: object's custom metadata, at most 8 KiB, so at most 8192 entries of it
OBJECT_NODES = 2 * 8192 + ENTRY_NODES

#: a JSON string: a quote, then escapes or anything but quotes and backslashes, then a quote
#: or the body's end (every search from a quote matches: no search is begun again from each
#: quote of an unterminated string, which would take a time quadratic in its length)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)


#: entries a listing page is asked for (S3's, GCS's and Azure's largest page)
PAGE_ENTRIES = 1000


def check_page_size(entries: int) -> None:
    """ValueError where a listing page names more entries than a page is asked for (no store
    sends more: such a page is a lie, refused before it is used)."""
    if entries > PAGE_ENTRIES:
        raise ValueError(f"a listing page of {entries} entries (at most {PAGE_ENTRIES} asked)")


def page_nodes(entries: int) -> int:
    """The nodes an answer listing at most `entries` entries may hold."""
    return (entries + 1) * ENTRY_NODES


def parse_json(body: bytes, nodes: int) -> Any:
    """`body` parsed as JSON holding at most `nodes` values and strings; ValueError where it
    holds more (before any is built), is not JSON, or nests too deep for the parser."""
    _check_json_nodes(body, nodes)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("the store's answer is not JSON") from None


def _check_json_nodes(body: bytes, nodes: int) -> None:
    # A string's opening quote never follows a backslash, so the quotes that do not are at
    # least as many as the strings: checked first, it bounds the pieces stripping them makes.
    strings = body.count(b'"') - body.count(b'\\"')
    if strings > 2 * nodes:  # keys and values
        raise ValueError(f"the store's answer holds {strings} strings or more, above the {2 * nodes} it may")
    # Outside strings, every value is the document, the first in its container, or after a
    # comma.  Where the body is not JSON, json.loads builds only what precedes its first
    # fault, where these counts are exact.
    bare = _JSON_STRING.sub(b"", body)
    values = 1 + bare.count(b"{") + bare.count(b"[") + bare.count(b",")
    if values > nodes:
        raise ValueError(f"the store's answer holds {values} values or more, above the {nodes} it may")


def parse_xml(body: bytes, nodes: int) -> ET.Element:
    """`body` parsed as XML in UTF-8 (what S3 and Azure answer; botocore parses so too) holding
    at most `nodes` tags and attributes; ValueError where it holds more (before any is built),
    is not XML, or declares a DTD."""
    check_xml(body, nodes)
    try:
        return ET.fromstring(body, ET.XMLParser(encoding="utf-8"))
    except ET.ParseError:
        raise ValueError("a listing that is not XML in UTF-8") from None


def check_xml(body: bytes, nodes: int) -> None:
    """What parse_xml checks before parsing, for answers another parser reads (botocore's).
    The DTD is found by the XML parser itself, before any entity is expanded: a search of the
    bytes for "<!DOCTYPE" would miss one spelled with character references or in another
    encoding, whose entities then expand an answer of 16 MiB into gigabytes."""
    if b"\0" in body:  # UTF-16 (a BOM makes the parser take it) or not XML
        raise ValueError("a listing that is not XML in UTF-8")
    # In UTF-8 every tag begins with "<", which text and attribute values never hold, and
    # every attribute's value with "=", XML's white space and a quote: counts never below
    # what is built (the parser is told UTF-8 whatever the answer declares: another encoding
    # could hide them).
    tags = body.count(b"<")
    if tags > nodes:
        raise ValueError(f"a listing of {tags} tags or more, above the {nodes} it may hold")
    if tags + body.count(b"=") > nodes:  # else no need to look closer
        bare = body.translate(None, b" \t\r\n")
        attributes = bare.count(b'="') + bare.count(b"='")
        if tags + attributes > nodes:
            raise ValueError(
                f"a listing of {tags} tags and {attributes} attributes or more, above the {nodes} it may hold"
            )
    scan = pyexpat.ParserCreate("utf-8")
    scan.StartDoctypeDeclHandler = _refuse_dtd
    try:
        scan.Parse(body, True)
    except pyexpat.ExpatError:
        raise ValueError("a listing that is not XML in UTF-8") from None


def _refuse_dtd(*args: object) -> None:
    raise ValueError("a listing that declares a DTD")
