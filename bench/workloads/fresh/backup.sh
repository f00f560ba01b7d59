#!/usr/bin/env bash
# Nightly backup of the photo library to the NAS, keeping the last 14 snapshots.
set -euo pipefail

SOURCE="${HOME}/Pictures/Library"
TARGET="/mnt/nas/backups/photos"
KEEP=14
STAMP="$(date +%Y-%m-%d)"

if [ ! -d "$TARGET" ]; then
    echo "backup: $TARGET is not mounted" >&2
    exit 1
fi

mkdir -p "$TARGET/$STAMP"
rsync -a --delete --link-dest="$TARGET/latest" "$SOURCE/" "$TARGET/$STAMP/"
ln -sfn "$TARGET/$STAMP" "$TARGET/latest"

# drop the oldest snapshots beyond KEEP
ls -1d "$TARGET"/20* | sort | head -n -"$KEEP" | while read -r old; do
    rm -rf "$old"
done

echo "backup: $STAMP done"
