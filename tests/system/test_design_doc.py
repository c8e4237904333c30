"""docs/DESIGN.md's contents list and the paths it names stay true to the document and the
tree: every heading is listed in order, every entry names a heading, and every file or
folder the document names in backquotes exists."""
import os
import re

ROOT = os.environ.get('FSDP_SOURCE_DIR') or os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))))
DESIGN = os.path.join(ROOT, 'docs', 'DESIGN.md')


def read():
    with open(DESIGN, encoding='utf-8') as f:
        return f.read()


def anchor(title):
    """GitHub's anchor for a heading."""
    return re.sub(r'[^\w\- ]', '', title.strip().lower()).replace(' ', '-')


def test_the_contents_list_every_heading_in_order():
    text = read()
    contents = text.split('## Contents', 1)[1].split('\n## ', 1)[0]
    listed = re.findall(r'^\s*- \[(.+?)\]\(#(.+?)\)$', contents, re.M)
    headings = [t for t in re.findall(r'^##+ (.+)$', text, re.M) if t != 'Contents']
    assert [t for t, _ in listed] == headings
    assert all(a == anchor(t) for t, a in listed)


def test_the_paths_it_names_exist():
    """A path in backquotes with a folder in it (`daemon/store/store.h`, `daemon/rpc/`)."""
    named = set(re.findall(r'`((?:daemon|common|proto|config|kernels|transport|collectives|'
                           r'checkpoint|cuda|client|fsdpctl|python|tests|bench|docs|include|'
                           r'systemd|scripts|examples)/[\w./-]*)`', read()))
    missing = sorted(p for p in named if '*' not in p and
                     not os.path.exists(os.path.join(ROOT, p.rstrip('/'))))
    assert not missing, f'docs/DESIGN.md names paths that do not exist: {missing}'
