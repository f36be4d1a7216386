#!/usr/bin/env bash
# Unpacks Debian 13's Vulkan headers into DEST (usage: vulkan_headers.sh DEST) for llama.cpp's Vulkan
# build: Debian 12's (1.3.239) predate VK_EXT_layer_settings, which llama.cpp's Vulkan code uses.
# Headers only: the loader and the driver stay the machine's own. The package comes through apt by
# name, from a temporary source list naming the Debian mirror this machine is already configured
# with, so no archive host or pool path is written here; the machine's own apt state is untouched.
set -euo pipefail
dest=$1
suite=trixie
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"  # apt downloads as its own user, _apt

# The machine's Debian mirror: the deb822 file Debian 12 ships, else the one-line sources.list.
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $0 ~ /debian/ && $0 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || { echo "no Debian mirror configured in /etc/apt: cannot fetch the Vulkan headers" >&2; exit 1; }

mkdir -p "$work/parts" "$work/lists/partial" "$work/cache/archives/partial"
printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" "$suite" > "$work/parts/headers.sources"
apt_in_work=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$work/parts"
             -o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache")
apt-get "${apt_in_work[@]}" update -q
(cd "$work" && apt-get "${apt_in_work[@]}" download libvulkan-dev)
mkdir -p "$dest"
dpkg -x "$work"/libvulkan-dev_*.deb "$dest"
echo "Vulkan headers $(dpkg-deb -f "$work"/libvulkan-dev_*.deb Version) unpacked in $dest"
