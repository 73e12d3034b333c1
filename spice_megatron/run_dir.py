"""A run directory nobody else writes.

A run directory holds what a resume executes: Megatron's distributed checkpoints are read with
pickle (`.metadata`, objects saved with the state), so whoever can write there can run code as
the job's owner at its next resume (and the Slurm job reads its counters from there). A checkpoint
is trusted like code. So a run creates its directory private (0700; 0750 with
run.group_readable), every rank writes under umask 077 (027), and a start or resume refuses a run
directory, or anything under its checkpoints, that is owned by another user or writable by group
or others, or under a parent another user controls: one line, before anything loads (and
again right before a checkpoint loads).
"""
from __future__ import annotations

import os
import pwd
import stat

from spice_megatron.entry import UserError

CHECKED_TREES = ("checkpoints",)  # what a resume loads


class UnsafeRunDir(UserError):
    pass


def run_umask(group_readable: bool) -> int:
    return 0o027 if group_readable else 0o077


def prepare_run_dir(path: str, group_readable: bool = False) -> None:
    """Creates `path` private if it is missing, then checks it and its checkpoints (UnsafeRunDir)."""
    os.umask(run_umask(group_readable))
    if not os.path.exists(path):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o750 if group_readable else 0o700)
    check_run_dir(path)


def check_ancestors(path: str, what: str = "run directory") -> None:
    """Every directory above `path` (resolved) is root's or the user's and writable by no one else,
    unless it is sticky (/tmp, shared scratch) and the next one down is the user's: otherwise
    another user could swap the run directory (or its checkpoints) for their own between the checks
    and the load (docs/cluster.md, "A run directory nobody else writes")."""
    me = os.geteuid()
    _check_links_on_the_way(path, what, me)
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for depth in range(len(parts) - 1, 0, -1):
        parent = os.sep.join(parts[:depth]) or os.sep
        child = os.sep.join(parts[:depth + 1])
        if not os.path.exists(parent):
            continue  # made by this run (private)
        st = os.stat(parent)
        others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid not in (0, me):
            raise UnsafeRunDir(f"{what} {path}: the directory above it, {parent}, is owned by {_owner(st.st_uid)}: "
                               "they could replace what it holds; use a directory under one of your own")
        sticky = bool(st.st_mode & stat.S_ISVTX)
        mine_below = not os.path.lexists(child) or os.lstat(child).st_uid == me
        if others_write and not (sticky and mine_below):
            why = f"sticky, but {child} is not yours" if sticky else "not sticky"
            raise UnsafeRunDir(f"{what} {path}: the directory above it, {parent}, is writable by others (mode "
                               f"{stat.S_IMODE(st.st_mode):o}, {why}): they could replace what it holds")


def _check_links_on_the_way(path: str, what: str, me: int) -> None:
    """Every link on `path` as given (the checks above see the resolved path only) is root's or the
    user's, in a directory nobody else can rewrite it in (writable by no one else, or sticky): another
    user's link, or one another user can replace, can be flipped between the checks and a load
    (docs/cluster.md, "A run directory nobody else writes")."""
    parts = os.path.abspath(path).split(os.sep)
    for depth in range(2, len(parts) + 1):
        here = os.sep.join(parts[:depth])
        try:
            st = os.lstat(here)
        except OSError:
            return  # made by this run from here on
        if not stat.S_ISLNK(st.st_mode):
            continue
        parent = os.stat(os.path.dirname(here))
        open_parent = parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not parent.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, me) or open_parent:
            whose = f"owned by {_owner(st.st_uid)}" if st.st_uid not in (0, me) else "in a directory others can write"
            raise UnsafeRunDir(f"{what} {path}: its way passes through {here}, a link {whose}: they could point "
                               "it elsewhere between the checks and a load; use the path it resolves to, or a link of "
                               "your own")


def check_run_dir(path: str) -> None:
    check_ancestors(path)
    _check(path, os.stat(path), "run directory")  # the directory itself may be a link the user made
    for tree in CHECKED_TREES:
        top = os.path.join(path, tree)
        if not os.path.lexists(top):
            continue
        _check(top, os.lstat(top), "run directory's")
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                p = os.path.join(root, name)
                _check(p, os.lstat(p), "checkpoint")


def check_checkpoint_tree(path: str) -> None:
    """A checkpoint about to be loaded (training, `spice eval`, the converters): its ancestors, itself
    and every file in it are the user's and writable by no one else."""
    check_ancestors(path, "checkpoint")
    _check(path, os.stat(path), "checkpoint")
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(root, name)
            _check(p, os.lstat(p), "checkpoint")


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _check(path: str, st: os.stat_result, what: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeRunDir(f"{what} {path} is owned by {_owner(st.st_uid)}, not {_owner(me)}: a resume would run what "
                           "it holds (checkpoints are trusted like code); use a run directory of your own")
    if stat.S_ISLNK(st.st_mode):
        return  # a link of our own: what it points to is checked where the walk reaches it (or not followed)
    writers = [who for bit, who in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others")) if st.st_mode & bit]
    if writers:
        raise UnsafeRunDir(f"{what} {path} is writable by {' and '.join(writers)} (mode {stat.S_IMODE(st.st_mode):o}): "
                           f"a resume would run what they put there; chmod -R go-w {path} if its contents are yours")
