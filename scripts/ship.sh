#!/usr/bin/env bash
# A file larger than one device call may carry (64 MiB with the checkout) goes to the GPU machine in
# pieces, one a call, and is joined and checked there.
#
#   here:   bash scripts/ship.sh split FILE              FILE's pieces in $SHIP_OUT (default .ship/:
#                                                        NAME.00, .01, ...;
#                                                        SHIP_PIECE bytes each, default 60 MiB), then
#                                                        one line per call to make, and FILE's sha256
#   there:  bash scripts/ship.sh put .ship/NAME.NN       with carry [".ship/NAME.NN"]: the piece kept
#                                                        in $SHIP_DIR (default /tmp/ship)
#   there:  bash scripts/ship.sh join NAME SHA256 DEST   the pieces joined in order into DEST, which is
#                                                        kept only if its sha256 is SHA256
#
# Files on the GPU machine outlive a call only while it stays warm (about 30 s idle), so the puts
# and the join go back to back. Each step prints one line and exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
keep=${SHIP_DIR:-/tmp/ship}
out=${SHIP_OUT:-.ship}
die() { echo "ship: $*" >&2; exit 1; }
case ${1:-} in
  split)
    file=${2:?usage: ship.sh split FILE}
    [ -f "$file" ] || die "no file $file"
    name=$(basename "$file")
    mkdir -p "$out" && rm -f "$out/$name".[0-9][0-9]
    split -b "${SHIP_PIECE:-60M}" -d "$file" "$out/$name." || die "cannot split $file"
    sum=$(sha256sum "$file" | cut -d' ' -f1)
    for piece in "$out/$name".[0-9][0-9]; do
      echo "put: carry [\"$piece\"], run: bash scripts/ship.sh put $piece"
    done
    echo "join: bash scripts/ship.sh join $name $sum DEST" ;;
  put)
    piece=${2:?usage: ship.sh put .ship/NAME.NN}
    [ -f "$piece" ] || die "no piece $piece here (carry it)"
    mkdir -p "$keep" && cp "$piece" "$keep/" || die "cannot keep $piece in $keep"
    echo "ship: $(basename "$piece") kept in $keep ($(ls "$keep" | wc -l) pieces there)" ;;
  join)
    name=${2:?usage: ship.sh join NAME SHA256 DEST}; want=${3:?usage: ship.sh join NAME SHA256 DEST}
    dest=${4:?usage: ship.sh join NAME SHA256 DEST}
    compgen -G "$keep/$name.[0-9][0-9]" >/dev/null || die "no pieces of $name in $keep"
    mkdir -p "$(dirname "$dest")" && cat "$keep/$name".[0-9][0-9] > "$dest.part" || die "cannot write $dest"
    got=$(sha256sum "$dest.part" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
      rm -f "$dest.part"
      die "$name: the joined pieces' sha256 is $got, not $want (a piece missing or from another file?)"
    fi
    mv "$dest.part" "$dest" && echo "ship: $dest ($(stat -c %s "$dest") bytes, sha256 checked)" ;;
  *) die "usage: ship.sh split FILE | put .ship/NAME.NN | join NAME SHA256 DEST" ;;
esac
