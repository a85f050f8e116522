#!/usr/bin/env bash
# Builds the container image (Dockerfile at the repository's root) with no registry:
#
#   1. the five binaries with cargo (the four of the Indexer and kv-indexer-sim, the simulated
#      worker the compose fleet runs), staged with their debug info stripped in target/image/bin,
#      the only files the build context sends (.dockerignore);
#   2. the base image, when its tag is missing locally: Debian's minbase made with debootstrap
#      (then its updates, and trimmed as the slim images are) and `docker import`ed under the
#      tag people pull (debian:bookworm-slim), so the same Dockerfile builds here and anywhere
#      a registry has the real one;
#   3. the Redis image for deploy/compose/ the same way (`--include redis-server`), tagged
#      redis:7.0-bookworm like the official image of the same Redis on the same Debian, so
#      the compose file works unchanged where that one can be pulled; and its Prometheus
#      (`--include prometheus`, Debian's 2.42.0) tagged prom/prometheus:v2.42.0;
#   4. `docker build`, then the image's size.
#
#   scripts/build_image.sh [--profile release|dev] [--tag kv-indexer:latest] [--no-cargo]
#                          [--no-redis] [--keep-debug] [--mirror URL]
#
#   --profile   cargo profile (default release; dev uses target/debug, what CI already built)
#   --no-cargo  use the binaries already in the profile's directory under $CARGO_TARGET_DIR
#               (default target)
#   --no-redis  skip the Redis and Prometheus images (the compose fleet's)
#   --keep-debug  stage the binaries as cargo wrote them (default: debug info stripped)
#   --mirror    Debian mirror for debootstrap and apt (default $DEBIAN_MIRROR or deb.debian.org;
#               security updates from $DEBIAN_SECURITY_MIRROR or deb.debian.org)
#
# Idempotent: a base or Redis image whose tag exists is not made again, and each bootstrap is
# kept as a tarball in $KV_IMAGE_CACHE (default ~/.cache/kv-indexer-image, with the .debs and
# apt lists both bootstraps share), so a removed tag is imported again without downloading;
# to take Debian's newer updates, remove the tags and that directory. The image itself is
# always built again (docker's layer cache makes that quick). Making a base needs root
# (debootstrap, chroot) and installs debootstrap with apt-get when missing. Prints how long
# each step took.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=release
TAG=kv-indexer:latest
BASE=debian:bookworm-slim
REDIS_TAG=redis:7.0-bookworm
PROMETHEUS_TAG=prom/prometheus:v2.42.0
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
CACHE=${KV_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-indexer-image}
CARGO=1
REDIS=1
STRIP=1
BINS=(kv-indexer-server kv-indexer-bridge kv-indexer-ctl kv-indexer-router kv-indexer-sim)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
while (($#)); do
  case $1 in
    --profile) PROFILE=${2:?--profile needs a name}; shift ;;
    --tag) TAG=${2:?--tag needs a tag}; shift ;;
    --mirror) MIRROR=${2:?--mirror needs a URL}; shift ;;
    --no-cargo) CARGO=0 ;;
    --no-redis) REDIS=0 ;;
    --keep-debug) STRIP=0 ;;
    -h | --help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
  shift
done
# cargo's output directory: CARGO_TARGET_DIR when set (relative to the checkout, as cargo
# reads it here), else target. The staging directory stays target/image (the build context).
case $PROFILE in
  dev | test) TARGET_DIR=${CARGO_TARGET_DIR:-target}/debug ;;
  *) TARGET_DIR=${CARGO_TARGET_DIR:-target}/$PROFILE ;;
esac

TIMES=()
timed() { # timed LABEL COMMAND...: runs it, remembers how long it took
  local label=$1 start end
  shift
  start=$(date +%s.%N)
  "$@"
  end=$(date +%s.%N)
  TIMES+=("$(awk -v s="$start" -v e="$end" -v l="$label" 'BEGIN { printf "%-34s %7.1f s", l, e - s }')")
}

has_image() { docker image inspect "$1" >/dev/null 2>&1; }

build_binaries() {
  local args=()
  for bin in "${BINS[@]}"; do args+=(--bin "$bin"); done
  cargo build --profile "$PROFILE" "${args[@]}"
}

stage_binaries() {
  rm -rf target/image/bin
  mkdir -p target/image/bin
  for bin in "${BINS[@]}"; do
    [[ -x $TARGET_DIR/$bin ]] || { echo "missing $TARGET_DIR/$bin (build it, or drop --no-cargo)" >&2; exit 1; }
    if ((STRIP)); then
      strip --strip-debug -o "target/image/bin/$bin" "$TARGET_DIR/$bin"
    else
      cp "$TARGET_DIR/$bin" "target/image/bin/$bin"
    fi
  done
  # Only glibc (and the loader) may be needed: the base has nothing else.
  if ldd target/image/bin/* | grep -v -E 'linux-vdso|libc\.so|libm\.so|libgcc_s\.so|ld-linux|libpthread|libdl|librt|^target/' ; then
    echo "the binaries need libraries the base image lacks (above)" >&2
    exit 1
  fi
  du -ch target/image/bin/* | tail -1 | sed 's/total/staged binaries/'
}

ensure_debootstrap() {
  command -v debootstrap >/dev/null && return
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}

# Configures a rootfs as the official slim images are (debuerreotype's slimify): dpkg installs
# no docs, man pages, info or translations; apt fetches no translations; the sources are the
# suite, its updates and its security updates.
configure_rootfs() {
  local dir=$1
  cat >"$dir/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
EOF
  echo 'Acquire::Languages "none";' >"$dir/etc/apt/apt.conf.d/docker-no-languages"
  cat >"$dir/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
}

# debootstrap installs the suite as released: the security and point-release updates since
# then come from apt, as in the official images. apt's lists and .debs are the cache's (both
# bootstraps share them); no service starts in the chroot meanwhile (policy-rc.d).
upgrade_rootfs() {
  local dir=$1 status=0
  mkdir -p "$CACHE/lists" "$CACHE/debs/partial"
  mount --bind "$CACHE/lists" "$dir/var/lib/apt/lists"
  mount --bind "$CACHE/debs" "$dir/var/cache/apt/archives"
  printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
  chmod +x "$dir/usr/sbin/policy-rc.d"
  chroot "$dir" apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive chroot "$dir" apt-get upgrade -y -qq -o Dpkg::Use-Pty=0 >/dev/null ||
    status=$?
  rm "$dir/usr/sbin/policy-rc.d"
  umount "$dir/var/cache/apt/archives" "$dir/var/lib/apt/lists"
  # From now on, as in the slim images, apt keeps no .debs.
  cat >"$dir/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";
EOF
  return "$status"
}

# Removes what the configuration keeps out of later installs, and the host's identity.
trim_rootfs() {
  local dir=$1
  find "$dir/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$dir/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$dir"/usr/share/{man,groff,info,lintian,linda}/* "$dir"/var/lib/apt/lists/*
  find "$dir/var/cache/apt" -type f -delete
  find "$dir/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
  find "$dir/var/log" -type f -delete
  rm -f "$dir"/var/cache/ldconfig/aux-cache "$dir/etc/hostname" "$dir/etc/machine-id"
  : >"$dir/etc/resolv.conf"
  : >"$dir/etc/hosts"
}

# rootfs_tar NAME [PACKAGES]: the cached tarball of a minbase bootstrap (with PACKAGES);
# `setup` (a function) runs on the rootfs before it is packed.
rootfs_tar() {
  local name=$1 include=${2:-} setup=${3:-true}
  local tar=$CACHE/$name.tar
  if [[ -s $tar ]]; then
    echo "using the cached bootstrap $tar" >&2
    echo "$tar"
    return
  fi
  [[ $(id -u) == 0 ]] || { echo "making $name needs root (debootstrap, chroot)" >&2; exit 1; }
  ensure_debootstrap
  mkdir -p "$CACHE/debs"
  local dir
  dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  echo "debootstrap --variant=minbase ${include:+--include=$include }$SUITE ($MIRROR) …" >&2
  debootstrap --variant=minbase ${include:+--include="$include"} --cache-dir="$CACHE/debs" \
    "$SUITE" "$dir" "$MIRROR" >"$CACHE/$name.debootstrap.log" 2>&1 ||
    { tail -20 "$CACHE/$name.debootstrap.log" >&2; rm -rf "$dir"; exit 1; }
  configure_rootfs "$dir"
  upgrade_rootfs "$dir" 2>>"$CACHE/$name.debootstrap.log" ||
    { tail -20 "$CACHE/$name.debootstrap.log" >&2; rm -rf "$dir"; exit 1; }
  trim_rootfs "$dir"
  "$setup" "$dir"
  tar --numeric-owner -C "$dir" -cf "$tar.tmp" .
  mv "$tar.tmp" "$tar"
  rm -rf "$dir"
  echo "$tar"
}

make_base() {
  if has_image "$BASE"; then
    echo "$BASE exists: not made again"
    return
  fi
  local tar
  tar=$(rootfs_tar "$SUITE-minbase")
  docker import --change 'CMD ["bash"]' --message "debootstrap --variant=minbase $SUITE $MIRROR" \
    "$tar" "$BASE" >/dev/null
  echo "made $BASE from Debian's packages"
}

redis_setup() { # the data directory, owned by the package's user
  mkdir -p "$1/data"
  chroot "$1" chown redis:redis /data
}

# make_service_image TAG NAME PACKAGE SETUP [--change …]…: TAG, when missing, from the cached
# minbase bootstrap NAME with PACKAGE (SETUP run on it), `docker import`ed with the changes.
make_service_image() {
  local tag=$1 name=$2 package=$3 setup=$4
  shift 4
  if has_image "$tag"; then
    echo "$tag exists: not made again"
    return
  fi
  local tar
  tar=$(rootfs_tar "$SUITE-minbase-$name" "$package" "$setup")
  docker import --message "debootstrap --variant=minbase --include=$package $SUITE $MIRROR" \
    "$@" "$tar" "$tag" >/dev/null
  echo "made $tag from Debian's packages"
}

make_redis() {
  # As the official image: redis-server in the foreground on /data, reachable from other
  # containers (without a config file Redis 7 refuses them: protected mode). SIGTERM, the
  # default stop signal, saves the AOF (docker import takes no STOPSIGNAL).
  make_service_image "$REDIS_TAG" redis redis-server redis_setup \
    --change 'USER redis' --change 'WORKDIR /data' --change 'VOLUME /data' --change 'EXPOSE 6379' \
    --change 'CMD ["redis-server", "--protected-mode", "no"]'
}

prometheus_setup() { # the data directory, owned by the package's user
  mkdir -p "$1/prometheus"
  chroot "$1" chown prometheus:prometheus /prometheus
}

make_prometheus() {
  # As the official image: prometheus as the entrypoint (on PATH there too), its data in
  # /prometheus, the configuration in /etc/prometheus (Debian's own example until a compose
  # file mounts one), the web UI and API on 9090.
  make_service_image "$PROMETHEUS_TAG" prometheus prometheus prometheus_setup \
    --change 'USER prometheus' --change 'WORKDIR /prometheus' --change 'VOLUME /prometheus' \
    --change 'EXPOSE 9090' --change 'ENTRYPOINT ["prometheus"]' \
    --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
}

build_image() {
  # The legacy builder needs no buildx and no registry (a missing buildx is only a warning).
  local log=target/image/docker-build.log
  if ! DOCKER_BUILDKIT=0 docker build --build-arg "BASE=$BASE" -t "$TAG" -f Dockerfile . >"$log" 2>&1; then
    grep -v -E 'DEPRECATED|legacy builder|buildx component|docs.docker.com/go/buildx' "$log" | tail -30 >&2
    echo "docker build failed (all of it in $log)" >&2
    exit 1
  fi
}

if ((CARGO)); then timed "cargo build ($PROFILE)" build_binaries; fi
timed "stage binaries" stage_binaries
timed "base image ($BASE)" make_base
if ((REDIS)); then
  timed "redis image ($REDIS_TAG)" make_redis
  timed "prometheus image ($PROMETHEUS_TAG)" make_prometheus
fi
timed "docker build ($TAG)" build_image

size_of() { numfmt --to=iec-i --suffix=B "$(docker image inspect -f '{{.Size}}' "$1")"; }
echo
printf '%s\n' "${TIMES[@]}"
echo "image $TAG: $(size_of "$TAG") (base $BASE: $(size_of "$BASE"))"
if ((REDIS)); then
  echo "image $REDIS_TAG: $(size_of "$REDIS_TAG")"
  echo "image $PROMETHEUS_TAG: $(size_of "$PROMETHEUS_TAG")"
fi
