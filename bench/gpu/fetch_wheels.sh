#!/usr/bin/env bash
# Download what bench/gpu/wheels.txt lists into .whl/ at the repository root (git-ignored; the device
# call carries it). Run here, on the development machine, before a device call:
#     bash bench/gpu/fetch_wheels.sh
# Wheels: the device README's exact pip command (CPython 3.12, manylinux x86_64, no deps: wheels.txt
# names every one). The sdist: pip download --no-binary. Debs: apt-get download (Debian's archive).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
wheels=() sdists=() debs=()
while read -r pin kind _; do
    case "$kind" in
        wheel) wheels+=("$pin") ;;
        sdist) sdists+=("$pin") ;;
        deb) debs+=("${pin%%==*}=${pin#*==}") ;;
    esac
done < <(sed -e 's/#.*//' bench/gpu/wheels.txt | awk 'NF')
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}"
python3 -m pip download --no-deps --no-binary=:all: -d .whl "${sdists[@]}"
(cd .whl && apt-get download "${debs[@]}")
du -sh .whl
PYTHONPATH=$PWD python3 bench/gpu/kit.py --dry --out "${TMPDIR:-/tmp}/tide-gpu-dry" >/dev/null && echo "wheel list complete (kit --dry: ok)"
