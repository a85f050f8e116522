//! The shared log: one Redis/Valkey stream that every replica of a fleet appends to and reads
//! in full, with the keys beside it (the stream's epoch, the maintenance lease, the published
//! snapshot).
//!
//! Keys, for a stream key `K` (`KV_INDEXER_EVENT_LOG_KEY`):
//! - `K`: the stream. Entries get ids `0-1`, `0-2`, … (`XADD K 0-*`: Redis picks the next
//!   sequence number, so appends from every replica interleave into one order with no gaps).
//!   The record at log position `p` has id `0-(p+1)`. An entry's fields: `r`, the replica that
//!   accepted it and its own counter (`<replica>:<n>`, so that replica answers the caller once
//!   it has applied the entry), and `d`, the record (`record::Record`'s bytes).
//! - `K:epoch`: a random name for this stream's history, set once (`SET NX`). A stream lost
//!   with its keys (`FLUSHALL`, a failover without persistence) comes back with another epoch,
//!   which tells every replica that its index is no longer explained by the log.
//! - `K:lease`: the replica that runs the fleet's maintenance (worker expiry, publishing
//!   snapshots, trimming), with an expiry; renewed by its holder only.
//! - `K:snapshot`: a hash describing the newest published snapshot (`position`, `epoch`,
//!   `chunks`, `bytes`); its bytes are in `K:snapshot:<position>:<i>`, at most
//!   [`CHUNK_BYTES`] each.
//!
//! Trimming (`XTRIM MINID`) removes only entries the snapshot a publication replaces covers, and
//! always keeps the newest covered entry, so the stream's last entry tells its tail.

use std::time::Duration;

use redis::{Commands, Connection, ConnectionLike, Value};

mod config;

pub use config::{StreamConfig, StreamConfigError};

/// Appends entries (`ARGV[2..]`: origin, record, origin, record, …) if the stream's epoch
/// (`KEYS[2]`) is `ARGV[1]`; answers their ids. A refused command (an ACL without it) is named
/// in the error, which Redis does not do for a script's calls.
const APPEND_SCRIPT: &str = r"
    local epoch = redis.pcall('GET', KEYS[2])
    if type(epoch) == 'table' and epoch.err then
        return redis.error_reply(epoch.err .. ' (GET ' .. KEYS[2] .. ')')
    end
    if epoch ~= ARGV[1] then
        return redis.error_reply('KVEPOCH the stream has lost the history this replica follows (another epoch, or none): not appending')
    end
    local ids = {}
    for i = 2, #ARGV, 2 do
        local id = redis.pcall('XADD', KEYS[1], '0-*', 'r', ARGV[i], 'd', ARGV[i + 1])
        if type(id) == 'table' and id.err then
            return redis.error_reply(id.err .. ' (XADD to ' .. KEYS[1] .. ')')
        end
        ids[#ids + 1] = id
    end
    return ids";

/// A published snapshot's chunk size.
pub const CHUNK_BYTES: usize = 4 << 20;
/// How long the chunks of a snapshot being published live unless the publish completes.
const UNPUBLISHED_CHUNK_TTL: Duration = Duration::from_secs(600);
/// How long the maintenance lease lasts without renewal.
pub const LEASE: Duration = Duration::from_secs(5);
/// Longest wait of one blocking read: the replica checks on Redis at least this often.
pub const READ_BLOCK: Duration = Duration::from_millis(100);
/// A reply slower than this is a Redis failure (a partition), not a slow answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest an append waits for its Redis replicas (`KV_INDEXER_EVENT_LOG_MIN_REPLICAS`).
pub const REPLICA_WAIT: Duration = Duration::from_secs(1);

/// What went wrong talking to Redis.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("the shared log at {url}: {op}")]
    Redis {
        url: String,
        op: &'static str,
        #[source]
        source: redis::RedisError,
    },
    #[error("the shared log at {url}: {what}")]
    Unexpected { url: String, what: String },
}

/// One entry read from the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub position: u64,
    /// Who accepted it: `<replica>:<n>`.
    pub origin: String,
    pub record: Vec<u8>,
}

/// The newest published snapshot, as described in `K:snapshot`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub position: u64,
    pub epoch: String,
    pub chunks: u64,
    pub bytes: u64,
}

/// A connection to the shared log.
pub struct Stream {
    connection: Connection,
    config: StreamConfig,
}

/// The id of the entry at `position`.
pub fn id(position: u64) -> String {
    format!("0-{}", position + 1)
}

/// The position of the entry with `id` (`0-<n>`, n ≥ 1).
fn position_of(id: &str) -> Option<u64> {
    id.strip_prefix("0-")?.parse::<u64>().ok()?.checked_sub(1)
}

impl StreamConfig {
    /// A new connection, with bounded connect, read and write times.
    pub fn connect(&self) -> Result<Stream, StreamError> {
        let connection = self
            .target
            .client()
            .and_then(|client| client.get_connection_with_timeout(IO_TIMEOUT))
            .map_err(self.redis_error("connecting"))?;
        connection
            .set_read_timeout(Some(IO_TIMEOUT + READ_BLOCK))
            .map_err(self.redis_error("setting the read timeout"))?;
        connection
            .set_write_timeout(Some(IO_TIMEOUT))
            .map_err(self.redis_error("setting the write timeout"))?;
        Ok(Stream {
            connection,
            config: self.clone(),
        })
    }

    fn redis_error(&self, op: &'static str) -> impl FnOnce(redis::RedisError) -> StreamError + '_ {
        move |source| StreamError::Redis {
            url: self.url.clone(),
            op,
            source,
        }
    }
}

impl Stream {
    fn key(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.config.key)
    }

    fn unexpected(&self, what: impl Into<String>) -> StreamError {
        StreamError::Unexpected {
            url: self.config.url.clone(),
            what: what.into(),
        }
    }

    /// Appends `records` in order, each with its origin, in one round trip, if the stream's
    /// epoch is still `epoch` (checked in the same script, so a Redis that lost the log, such
    /// as a primary restarted empty, refuses the append instead of taking entries no replica
    /// will read); returns their positions.
    pub fn append(
        &mut self,
        epoch: &str,
        records: &[(String, Vec<u8>)],
    ) -> Result<Vec<u64>, StreamError> {
        let mut pipe = redis::pipe();
        let append = pipe
            .cmd("EVAL")
            .arg(APPEND_SCRIPT)
            .arg(2)
            .arg(&self.config.key)
            .arg(self.key("epoch"))
            .arg(epoch);
        for (origin, record) in records {
            append.arg(origin).arg(record);
        }
        let wanted = self.config.min_replicas;
        if wanted > 0 {
            pipe.cmd("WAIT")
                .arg(wanted)
                .arg(REPLICA_WAIT.as_millis() as u64);
        }
        let mut answers: Vec<Value> = pipe.query(&mut self.connection).map_err(
            self.config
                .redis_error("appending (the epoch check and XADD)"),
        )?;
        if wanted > 0 {
            let acked = match answers.pop() {
                Some(Value::Int(acked)) => acked,
                other => return Err(self.unexpected(format!("WAIT answered {other:?}"))),
            };
            if acked < i64::from(wanted) {
                return Err(self.unexpected(format!(
                    "{acked} of the {wanted} Redis replicas KV_INDEXER_EVENT_LOG_MIN_REPLICAS asks for hold the append after {} ms",
                    REPLICA_WAIT.as_millis()
                )));
            }
        }
        let ids = match answers.pop() {
            Some(Value::Array(ids)) if answers.is_empty() => ids,
            other => return Err(self.unexpected(format!("the append script answered {other:?}"))),
        };
        ids.into_iter()
            .map(|answer| {
                let id: String = redis::from_redis_value(answer)
                    .map_err(|error| self.unexpected(format!("XADD answered {error}")))?;
                position_of(&id).ok_or_else(|| {
                    self.unexpected(format!("XADD answered id {id:?}, not 0-<n>: another writer uses the key with its own ids"))
                })
            })
            .collect()
    }

    /// Up to `count` entries from `position` on, waiting up to `block` for the first.
    pub fn read_from(
        &mut self,
        position: u64,
        count: usize,
        block: Option<Duration>,
    ) -> Result<Vec<Entry>, StreamError> {
        // XREAD answers the entries after the id given: the one before `position`.
        let after = match position {
            0 => "0-0".to_owned(),
            p => id(p - 1),
        };
        let mut command = redis::cmd("XREAD");
        command.arg("COUNT").arg(count);
        if let Some(block) = block {
            command.arg("BLOCK").arg(block.as_millis() as u64);
        }
        command.arg("STREAMS").arg(&self.config.key).arg(after);
        let reply: Value = command
            .query(&mut self.connection)
            .map_err(self.config.redis_error("reading (XREAD)"))?;
        let entries = match reply {
            Value::Nil => return Ok(Vec::new()),
            Value::Array(mut streams) if streams.len() == 1 => match streams.pop() {
                Some(Value::Array(mut pair)) if pair.len() == 2 => pair.pop(),
                _ => None,
            },
            Value::Map(mut streams) if streams.len() == 1 => streams.pop().map(|(_, v)| v),
            _ => None,
        };
        match entries {
            Some(Value::Array(entries)) => entries.into_iter().map(|e| self.entry(e)).collect(),
            _ => Err(self.unexpected("XREAD answered something that is not one stream's entries")),
        }
    }

    /// Hands `each` the entries from `from` up to (not including) `until`, read in pages.
    pub fn range(
        &mut self,
        from: u64,
        until: u64,
        mut each: impl FnMut(Entry),
    ) -> Result<(), StreamError> {
        let mut next = from;
        while next < until {
            let page = self.read_from(next, 1024.min((until - next) as usize), None)?;
            let Some(last) = page.last() else { break };
            next = last.position + 1;
            page.into_iter()
                .filter(|e| e.position < until)
                .for_each(&mut each);
        }
        Ok(())
    }

    fn entry(&self, value: Value) -> Result<Entry, StreamError> {
        let bad = || self.unexpected("a stream entry that is not [id, [field, value, …]]");
        let Value::Array(mut pair) = value else {
            return Err(bad());
        };
        if pair.len() != 2 {
            return Err(bad());
        }
        let fields = pair.pop().expect("two items");
        let id: String =
            redis::from_redis_value(pair.pop().expect("two items")).map_err(|_| bad())?;
        let position = position_of(&id)
            .ok_or_else(|| self.unexpected(format!("entry id {id:?} is not 0-<n>")))?;
        let fields: Vec<Vec<u8>> = match fields {
            Value::Map(map) => map
                .into_iter()
                .flat_map(|(k, v)| [k, v])
                .map(redis::from_redis_value)
                .collect::<Result<_, _>>()
                .map_err(|_| bad())?,
            other => redis::from_redis_value(other).map_err(|_| bad())?,
        };
        let (mut origin, mut record) = (None, None);
        for pair in fields.chunks_exact(2) {
            match pair[0].as_slice() {
                b"r" => origin = Some(String::from_utf8_lossy(&pair[1]).into_owned()),
                b"d" => record = Some(pair[1].clone()),
                _ => {}
            }
        }
        match (origin, record) {
            (Some(origin), Some(record)) => Ok(Entry {
                position,
                origin,
                record,
            }),
            _ => Err(self.unexpected(format!("entry {id} has no r and d fields"))),
        }
    }

    /// The positions of the stream's first and last entries (none: no stream or no entry).
    pub fn bounds(&mut self) -> Result<Option<(u64, u64)>, StreamError> {
        let first = self.edge("XRANGE", "-", "+")?;
        let last = self.edge("XREVRANGE", "+", "-")?;
        Ok(first.zip(last))
    }

    fn edge(&mut self, command: &str, from: &str, to: &str) -> Result<Option<u64>, StreamError> {
        let reply: Vec<(String, Value)> = redis::cmd(command)
            .arg(&self.config.key)
            .arg(from)
            .arg(to)
            .arg("COUNT")
            .arg(1)
            .query(&mut self.connection)
            .map_err(self.config.redis_error("reading the stream's bounds"))?;
        match reply.first() {
            None => Ok(None),
            Some((id, _)) => position_of(id)
                .map(Some)
                .ok_or_else(|| self.unexpected(format!("entry id {id:?} is not 0-<n>"))),
        }
    }

    /// The stream's epoch, set to `candidate` if it had none.
    pub fn epoch(&mut self, candidate: &str) -> Result<String, StreamError> {
        let key = self.key("epoch");
        let _: Value = redis::cmd("SET")
            .arg(&key)
            .arg(candidate)
            .arg("NX")
            .query(&mut self.connection)
            .map_err(self.config.redis_error("setting the epoch"))?;
        let epoch: Option<String> = self
            .connection
            .get(&key)
            .map_err(self.config.redis_error("reading the epoch"))?;
        epoch.ok_or_else(|| self.unexpected("the epoch key vanished right after it was set"))
    }

    /// The stream's epoch as it is (none: the keys are gone).
    pub fn current_epoch(&mut self) -> Result<Option<String>, StreamError> {
        self.connection
            .get(self.key("epoch"))
            .map_err(self.config.redis_error("reading the epoch"))
    }

    /// Takes or renews the maintenance lease for `replica`; whether it holds it now.
    pub fn hold_lease(&mut self, replica: &str) -> Result<bool, StreamError> {
        let script = redis::Script::new(
            r"
            local holder = redis.call('GET', KEYS[1])
            if holder == false then
                redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
                return 1
            elseif holder == ARGV[1] then
                redis.call('PEXPIRE', KEYS[1], ARGV[2])
                return 1
            end
            return 0",
        );
        let held: i64 = script
            .key(self.key("lease"))
            .arg(replica)
            .arg(LEASE.as_millis() as u64)
            .invoke(&mut self.connection)
            .map_err(self.config.redis_error("taking the lease"))?;
        Ok(held == 1)
    }

    /// Gives up the maintenance lease if `replica` holds it.
    pub fn release_lease(&mut self, replica: &str) -> Result<(), StreamError> {
        let script = redis::Script::new(
            r"
            if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
            return 0",
        );
        let _: i64 = script
            .key(self.key("lease"))
            .arg(replica)
            .invoke(&mut self.connection)
            .map_err(self.config.redis_error("releasing the lease"))?;
        Ok(())
    }

    /// The newest published snapshot's description.
    pub fn published(&mut self) -> Result<Option<Published>, StreamError> {
        let fields: std::collections::HashMap<String, String> = self
            .connection
            .hgetall(self.key("snapshot"))
            .map_err(self.config.redis_error("reading the published snapshot"))?;
        if fields.is_empty() {
            return Ok(None);
        }
        let number = |name: &str| fields.get(name).and_then(|v| v.parse::<u64>().ok());
        match (
            number("position"),
            fields.get("epoch"),
            number("chunks"),
            number("bytes"),
        ) {
            (Some(position), Some(epoch), Some(chunks), Some(bytes)) => Ok(Some(Published {
                position,
                epoch: epoch.clone(),
                chunks,
                bytes,
            })),
            _ => Err(self.unexpected(format!(
                "{} does not describe a snapshot",
                self.key("snapshot")
            ))),
        }
    }

    /// The bytes of the published snapshot `published`; none when its chunks are gone (a
    /// newer one replaced it meanwhile).
    pub fn fetch(&mut self, published: &Published) -> Result<Option<Vec<u8>>, StreamError> {
        // A size read from Redis is a hint, not a promise: capped.
        let mut bytes = Vec::with_capacity(published.bytes.min(1 << 30) as usize);
        for i in 0..published.chunks {
            let chunk: Option<Vec<u8>> = self
                .connection
                .get(self.key(&format!("snapshot:{}:{i}", published.position)))
                .map_err(self.config.redis_error("reading a snapshot chunk"))?;
            match chunk {
                Some(chunk) => bytes.extend_from_slice(&chunk),
                None => return Ok(None),
            }
        }
        Ok((bytes.len() as u64 == published.bytes).then_some(bytes))
    }

    /// Publishes `bytes` as the snapshot at `position` of `epoch` if `replica` still holds the
    /// lease and nothing newer is published, deletes the one it replaces and trims the stream
    /// below that one (not below the new one: a replica cut off while the new one was built
    /// still finds the entries after its position, at the price of about two snapshot
    /// intervals of stream in Redis instead of one). Whether it was published.
    pub fn publish(
        &mut self,
        replica: &str,
        epoch: &str,
        position: u64,
        bytes: &[u8],
    ) -> Result<bool, StreamError> {
        if self
            .published()?
            .is_some_and(|before| before.position >= position)
        {
            return Ok(false);
        }
        let chunks = bytes.len().div_ceil(CHUNK_BYTES) as u64;
        self.write_chunks(position, bytes)?;
        match self.commit(replica, epoch, position, chunks, bytes.len() as u64)? {
            Some(replaced) => {
                if let Some((old_position, old_chunks)) = replaced {
                    self.delete_chunks(old_position, old_chunks)?;
                    self.trim_below(old_position)?;
                }
                Ok(true)
            }
            // Lost the lease or the epoch, or a newer one was published meanwhile.
            None => {
                self.delete_chunks(position, chunks)?;
                Ok(false)
            }
        }
    }

    /// Writes the chunks of a snapshot, expiring until [`Stream::commit`] publishes them (a
    /// crash mid-publish leaves nothing behind for good).
    fn write_chunks(&mut self, position: u64, bytes: &[u8]) -> Result<(), StreamError> {
        let mut pipe = redis::pipe();
        for (i, chunk) in bytes.chunks(CHUNK_BYTES).enumerate() {
            pipe.pset_ex(
                self.key(&format!("snapshot:{position}:{i}")),
                chunk,
                UNPUBLISHED_CHUNK_TTL.as_millis() as u64,
            )
            .ignore();
        }
        pipe.query::<()>(&mut self.connection)
            .map_err(self.config.redis_error("writing snapshot chunks"))
    }

    /// Describes the written chunks as the published snapshot, in one script that checks the
    /// lease, the epoch and that nothing newer is published. None when it did not publish;
    /// else the snapshot it replaced (position, chunks), if any.
    fn commit(
        &mut self,
        replica: &str,
        epoch: &str,
        position: u64,
        chunks: u64,
        bytes: u64,
    ) -> Result<Option<Option<(u64, u64)>>, StreamError> {
        let script = redis::Script::new(
            r"
            if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0} end
            if redis.call('GET', KEYS[3]) ~= ARGV[2] then return {0} end
            local old = redis.call('HMGET', KEYS[2], 'position', 'chunks')
            local newest = tonumber(old[1] or '-1')
            if newest >= tonumber(ARGV[3]) then return {0} end
            redis.call('HSET', KEYS[2], 'position', ARGV[3], 'epoch', ARGV[2],
                'chunks', ARGV[4], 'bytes', ARGV[5])
            for i = 0, tonumber(ARGV[4]) - 1 do
                redis.call('PERSIST', ARGV[6] .. i)
            end
            if newest < 0 then return {1} end
            return {1, newest, tonumber(old[2] or '0')}",
        );
        let answer: Vec<i64> = script
            .key(self.key("lease"))
            .key(self.key("snapshot"))
            .key(self.key("epoch"))
            .arg(replica)
            .arg(epoch)
            .arg(position)
            .arg(chunks)
            .arg(bytes)
            .arg(self.key(&format!("snapshot:{position}:")))
            .invoke(&mut self.connection)
            .map_err(self.config.redis_error("publishing the snapshot"))?;
        Ok(match answer.as_slice() {
            [1] => Some(None),
            [1, old_position, old_chunks] => Some(Some((*old_position as u64, *old_chunks as u64))),
            _ => None,
        })
    }

    fn delete_chunks(&mut self, position: u64, chunks: u64) -> Result<(), StreamError> {
        let keys: Vec<String> = (0..chunks)
            .map(|i| self.key(&format!("snapshot:{position}:{i}")))
            .collect();
        if keys.is_empty() {
            return Ok(());
        }
        let _: i64 = self
            .connection
            .del(keys)
            .map_err(self.config.redis_error("deleting an old snapshot"))?;
        Ok(())
    }

    /// Trims the entries a snapshot at `position` covers, keeping the newest of them
    /// (`position - 1`), so the stream's tail stays readable. Approximate (`~`): Redis
    /// trims whole nodes only, quickly, and may keep a few more entries; never fewer.
    fn trim_below(&mut self, position: u64) -> Result<(), StreamError> {
        let _: i64 = redis::cmd("XTRIM")
            .arg(&self.config.key)
            .arg("MINID")
            .arg("~")
            .arg(id(position - 1))
            .query(&mut self.connection)
            .map_err(self.config.redis_error("trimming (XTRIM)"))?;
        Ok(())
    }

    /// Bytes Redis uses for the stream (`MEMORY USAGE`).
    pub fn memory(&mut self) -> Result<u64, StreamError> {
        let bytes: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&self.config.key)
            .arg("SAMPLES")
            .arg(0)
            .query(&mut self.connection)
            .map_err(self.config.redis_error("MEMORY USAGE"))?;
        Ok(bytes.unwrap_or(0))
    }

    /// Whether the connection still works (no command sent).
    pub fn is_open(&self) -> bool {
        self.connection.is_open()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_positions_map_one_to_one() {
        for position in [0, 1, 41, u64::MAX - 1] {
            assert_eq!(position_of(&id(position)), Some(position));
        }
        assert_eq!(position_of("0-0"), None);
        assert_eq!(position_of("1700000000000-0"), None);
        assert_eq!(position_of("0-x"), None);
    }
}
