//! The stored conversations of `/v1/responses`: each stored response, as its object, as the chat
//! conversation it ended (the history a `previous_response_id` follow-up continues) and as its
//! request's input items (what `/input_items` lists), in an embedded SQLite file under the cache
//! folder. The store is bounded in bytes and in age: a put past the size
//! bound evicts the oldest responses first, and responses older than the age bound are gone. Neither
//! ever fails a request; both are counted for /metrics.
//!
//! The file is opened at first use, so a server that never stores a response never creates one.
//! Its tables are created when missing, so a file from before the input items were kept gains their
//! table, and its responses list no input items.
//! Its totals are kept in this process: one file per frontend (the default path names the port).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension};

/// How much the store keeps.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreBounds {
    /// The bytes of all stored objects, histories and input items together.
    pub max_bytes: u64,
    /// How long a response stays retrievable.
    pub max_age: Duration,
}

/// A stored response: its object, its conversation and its input items, all as JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub response: String,
    pub history: String,
    pub input_items: String,
}

/// What /metrics shows of the store.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreStats {
    pub stored: u64,
    pub bytes: u64,
    pub evicted_for_size: u64,
    pub evicted_for_age: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("the response store {path}: {source}")]
pub struct StoreError {
    path: String,
    source: rusqlite::Error,
}

pub struct ResponseStore {
    path: PathBuf,
    bounds: StoreBounds,
    db: Mutex<Option<Db>>,
    evicted_for_size: AtomicU64,
    evicted_for_age: AtomicU64,
}

/// The open file and its totals.
struct Db {
    connection: Connection,
    stored: u64,
    bytes: u64,
}

const SCHEMA: &str = "
    PRAGMA journal_mode = WAL;
    PRAGMA synchronous = NORMAL;
    PRAGMA foreign_keys = ON;
    CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY,
        created_at INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        response TEXT NOT NULL,
        history TEXT NOT NULL
    );
    CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
    CREATE TABLE IF NOT EXISTS input_items (
        response_id TEXT PRIMARY KEY REFERENCES responses (id) ON DELETE CASCADE,
        items TEXT NOT NULL
    );
";

impl ResponseStore {
    pub fn new(path: PathBuf, bounds: StoreBounds) -> Self {
        assert!(bounds.max_bytes > 0, "a store must hold something");
        ResponseStore {
            path,
            bounds,
            db: Mutex::new(None),
            evicted_for_size: AtomicU64::new(0),
            evicted_for_age: AtomicU64::new(0),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stores a response made at `created_at` (unix seconds, which is now), evicting the oldest
    /// ones while the store would be over its size bound. A response larger than the whole bound is
    /// not kept.
    pub fn put(
        &self,
        id: &str,
        created_at: u64,
        stored: &StoredResponse,
    ) -> Result<(), StoreError> {
        let bytes =
            (stored.response.len() + stored.history.len() + stored.input_items.len()) as u64;
        self.with_db(true, |db| {
            self.expire(db, created_at)?;
            if bytes > self.bounds.max_bytes {
                self.evicted_for_size.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            self.evict_oldest(db, self.bounds.max_bytes - bytes)?;
            db.connection.execute(
                "INSERT OR REPLACE INTO responses (id, created_at, bytes, response, history) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    id,
                    created_at as i64,
                    bytes as i64,
                    stored.response,
                    stored.history
                ],
            )?;
            db.connection.execute(
                "INSERT OR REPLACE INTO input_items (response_id, items) VALUES (?1, ?2)",
                params![id, stored.input_items],
            )?;
            db.recount()
        })
        .map(|_| ())
    }

    /// The stored response `id`, unless it was never stored, was deleted, or has been evicted or
    /// has expired by `now` (unix seconds).
    pub fn get(&self, id: &str, now: u64) -> Result<Option<StoredResponse>, StoreError> {
        self.with_db(false, |db| {
            self.expire(db, now)?;
            db.connection
                .query_row(
                    "SELECT response, history, COALESCE(items, '[]') FROM responses \
                     LEFT JOIN input_items ON response_id = id WHERE id = ?1",
                    params![id],
                    |row| {
                        Ok(StoredResponse {
                            response: row.get(0)?,
                            history: row.get(1)?,
                            input_items: row.get(2)?,
                        })
                    },
                )
                .optional()
        })
        .map(Option::flatten)
    }

    /// Deletes `id`; whether it was there (and not expired by `now`).
    pub fn delete(&self, id: &str, now: u64) -> Result<bool, StoreError> {
        self.with_db(false, |db| {
            self.expire(db, now)?;
            let deleted = db
                .connection
                .execute("DELETE FROM responses WHERE id = ?1", params![id])?;
            db.recount()?;
            Ok(deleted > 0)
        })
        .map(|deleted| deleted == Some(true))
    }

    pub fn stats(&self) -> StoreStats {
        let guard = self.db.lock().expect("the store's lock is never poisoned");
        let (stored, bytes) = guard.as_ref().map_or((0, 0), |db| (db.stored, db.bytes));
        StoreStats {
            stored,
            bytes,
            evicted_for_size: self.evicted_for_size.load(Ordering::Relaxed),
            evicted_for_age: self.evicted_for_age.load(Ordering::Relaxed),
        }
    }

    /// Runs `work` on the open file (opening it first if need be); None, without running it, when
    /// the file does not exist and `create` is false (a read before anything was stored).
    fn with_db<T>(
        &self,
        create: bool,
        work: impl FnOnce(&mut Db) -> rusqlite::Result<T>,
    ) -> Result<Option<T>, StoreError> {
        let mut guard = self.db.lock().expect("the store's lock is never poisoned");
        if guard.is_none() && !create && !self.path.exists() {
            return Ok(None);
        }
        let result = match &mut *guard {
            Some(db) => work(db),
            None => Db::open(&self.path).and_then(|mut db| {
                let result = work(&mut db);
                *guard = Some(db);
                result
            }),
        };
        result.map(Some).map_err(|source| StoreError {
            path: self.path.display().to_string(),
            source,
        })
    }

    /// Deletes what is older than the age bound.
    fn expire(&self, db: &mut Db, now: u64) -> rusqlite::Result<()> {
        let cutoff = now.saturating_sub(self.bounds.max_age.as_secs());
        let expired = db.connection.execute(
            "DELETE FROM responses WHERE created_at < ?1",
            params![cutoff as i64],
        )?;
        if expired > 0 {
            self.evicted_for_age
                .fetch_add(expired as u64, Ordering::Relaxed);
            db.recount()?;
        }
        Ok(())
    }

    /// Deletes the oldest responses until at most `keep_bytes` remain.
    fn evict_oldest(&self, db: &mut Db, keep_bytes: u64) -> rusqlite::Result<()> {
        if db.bytes <= keep_bytes {
            return Ok(());
        }
        let mut to_free = db.bytes - keep_bytes;
        let mut evicted = 0u64;
        {
            let mut oldest = db
                .connection
                .prepare("SELECT bytes FROM responses ORDER BY created_at, rowid")?;
            let mut rows = oldest.query([])?;
            while to_free > 0 {
                let Some(row) = rows.next()? else { break };
                to_free = to_free.saturating_sub(row.get::<_, i64>(0)? as u64);
                evicted += 1;
            }
        }
        db.connection.execute(
            "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses \
             ORDER BY created_at, rowid LIMIT ?1)",
            params![evicted as i64],
        )?;
        self.evicted_for_size.fetch_add(evicted, Ordering::Relaxed);
        db.recount()
    }
}

impl Db {
    fn open(path: &Path) -> rusqlite::Result<Db> {
        if let Some(folder) = path.parent() {
            // An error here comes back from the open below, which names the file.
            let _ = std::fs::create_dir_all(folder);
        }
        let connection = Connection::open(path)?;
        connection.busy_timeout(Duration::from_secs(5))?;
        connection.execute_batch(SCHEMA)?;
        let mut db = Db {
            connection,
            stored: 0,
            bytes: 0,
        };
        db.recount()?;
        Ok(db)
    }

    fn recount(&mut self) -> rusqlite::Result<()> {
        let (stored, bytes): (i64, i64) = self.connection.query_row(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses",
            [],
            |row| Ok((row.get(0)?, row.get(1)?)),
        )?;
        self.stored = stored as u64;
        self.bytes = bytes as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store_in(folder: &Path, max_bytes: u64, max_age: Duration) -> ResponseStore {
        ResponseStore::new(
            folder.join("responses.sqlite3"),
            StoreBounds { max_bytes, max_age },
        )
    }

    fn temp_folder(name: &str) -> PathBuf {
        let folder =
            std::env::temp_dir().join(format!("sluice-store-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&folder);
        folder
    }

    /// A response whose history and input items are empty lists (2 bytes each).
    fn entry(response: &str) -> StoredResponse {
        StoredResponse {
            response: response.into(),
            history: "[]".into(),
            input_items: "[]".into(),
        }
    }

    const DAY: Duration = Duration::from_secs(86_400);
    /// A time in unix seconds: the store takes the time from its callers.
    const NOW: u64 = 1_800_000_000;

    #[test]
    fn a_stored_response_reads_back_until_deleted() {
        let folder = temp_folder("roundtrip");
        let store = store_in(&folder, 1 << 20, DAY);
        assert_eq!(store.get("resp_1", NOW).unwrap(), None);
        assert!(!store.delete("resp_1", NOW).unwrap());
        assert!(!store.path().exists(), "created only by the first put");
        let stored = StoredResponse {
            input_items: "[{\"id\":\"msg_1\"}]".into(),
            ..entry("{\"id\":1}")
        };
        store.put("resp_1", NOW, &stored).unwrap();
        assert!(store.path().exists());
        assert_eq!(store.get("resp_1", NOW).unwrap(), Some(stored));
        assert_eq!(store.get("resp_2", NOW).unwrap(), None);
        assert_eq!(store.stats().stored, 1);
        assert_eq!(store.stats().bytes, 26);
        assert!(store.delete("resp_1", NOW).unwrap());
        assert!(!store.delete("resp_1", NOW).unwrap());
        assert_eq!(store.get("resp_1", NOW).unwrap(), None);
        assert_eq!(store.stats().stored, 0);
        // A new process finds what the file holds.
        store.put("resp_3", NOW, &entry("{}")).unwrap();
        drop(store);
        let reopened = store_in(&folder, 1 << 20, DAY);
        assert!(reopened.get("resp_3", NOW).unwrap().is_some());
        assert_eq!(reopened.stats().stored, 1);
        std::fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn past_the_size_bound_the_oldest_go_first_and_are_counted() {
        let folder = temp_folder("size");
        // Each response is 100 bytes; the bound holds 3.
        let store = store_in(&folder, 350, DAY);
        let body = "x".repeat(96);
        for i in 0..5 {
            store.put(&format!("r{i}"), NOW, &entry(&body)).unwrap();
        }
        let kept: Vec<bool> = (0..5)
            .map(|i| store.get(&format!("r{i}"), NOW).unwrap().is_some())
            .collect();
        assert_eq!(kept, [false, false, true, true, true]);
        let stats = store.stats();
        assert_eq!((stats.stored, stats.bytes), (3, 300));
        assert_eq!(stats.evicted_for_size, 2);
        // One larger than the whole bound is not kept, and evicts nothing.
        store.put("huge", NOW, &entry(&"y".repeat(400))).unwrap();
        assert_eq!(store.get("huge", NOW).unwrap(), None);
        assert_eq!(store.stats().stored, 3);
        assert_eq!(store.stats().evicted_for_size, 3);
        std::fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn responses_older_than_the_age_bound_are_gone_and_counted() {
        let folder = temp_folder("age");
        let store = store_in(&folder, 1 << 20, Duration::from_secs(60));
        store.put("old", NOW - 120, &entry("{}")).unwrap();
        store.put("new", NOW, &entry("{}")).unwrap();
        assert_eq!(store.get("old", NOW).unwrap(), None);
        assert!(store.get("new", NOW).unwrap().is_some());
        assert_eq!(store.stats().evicted_for_age, 1);
        assert_eq!(store.stats().stored, 1);
        std::fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn a_file_from_before_input_items_gains_their_table_and_lists_none() {
        let folder = temp_folder("migrate");
        std::fs::create_dir_all(&folder).unwrap();
        let path = folder.join("responses.sqlite3");
        let old = Connection::open(&path).unwrap();
        old.execute_batch(
            "CREATE TABLE responses (id TEXT PRIMARY KEY, created_at INTEGER NOT NULL, \
             bytes INTEGER NOT NULL, response TEXT NOT NULL, history TEXT NOT NULL);",
        )
        .unwrap();
        old.execute(
            "INSERT INTO responses VALUES ('resp_old', ?1, 4, '{}', '[]')",
            params![NOW as i64],
        )
        .unwrap();
        drop(old);
        let store = store_in(&folder, 1 << 20, DAY);
        assert_eq!(store.get("resp_old", NOW).unwrap(), Some(entry("{}")));
        store
            .put(
                "resp_new",
                NOW,
                &StoredResponse {
                    input_items: "[1]".into(),
                    ..entry("{}")
                },
            )
            .unwrap();
        assert_eq!(
            store.get("resp_new", NOW).unwrap().unwrap().input_items,
            "[1]"
        );
        std::fs::remove_dir_all(folder).unwrap();
    }

    #[test]
    fn input_items_go_with_their_response() {
        let folder = temp_folder("cascade");
        let store = store_in(&folder, 1 << 20, Duration::from_secs(60));
        store.put("old", NOW - 120, &entry("{}")).unwrap();
        store.put("gone", NOW, &entry("{}")).unwrap();
        store.put("kept", NOW, &entry("{}")).unwrap();
        assert!(store.delete("gone", NOW).unwrap());
        let items: Vec<String> = Connection::open(store.path())
            .unwrap()
            .prepare("SELECT response_id FROM input_items")
            .unwrap()
            .query_map([], |row| row.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(items, ["kept"]);
        std::fs::remove_dir_all(folder).unwrap();
    }
}
